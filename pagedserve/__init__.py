"""pagedserve: an LLM serving engine built around PagedAttention."""
from pagedserve.engine.llm import LLM
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "BeamSearchOutput", "BeamSearchSequence", "InvalidRequestError"]
__version__ = "0.1.0"
