"""pagedserve: an LLM serving engine built around PagedAttention."""
from pagedserve.engine.llm import LLM
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "BeamSearchOutput", "BeamSearchSequence", "InvalidRequestError", "StructuredOutputsParams"]
__version__ = "0.1.0"
