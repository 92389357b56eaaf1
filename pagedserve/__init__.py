"""pagedserve: an LLM serving engine built around PagedAttention."""
# First, before anything loads torch (and with it OpenMP): threads that do not spin-wait.
from pagedserve.kernels.threads import apply_openmp_defaults

apply_openmp_defaults()

from pagedserve.engine.llm import LLM  # noqa: E402
from pagedserve.errors import InvalidRequestError
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput, EmbeddingOutput,
                                EmbeddingRequestOutput, RequestOutput)
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedserve.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "BeamSearchOutput", "BeamSearchSequence", "InvalidRequestError", "RequestOutputKind",
           "StructuredOutputsParams", "PoolingParams", "EmbeddingOutput", "EmbeddingRequestOutput", "LoRARequest"]
__version__ = "0.1.0"
