"""pyllama-paged: quantized GGUF models on GGML with a paged KV cache.

The package root is the user API: `Llama` (llama-cpp-python's) and its companion classes,
`EngineLoop` for many callers of one engine, and the errors. The engine's parts live in
`pyllama_paged.engine` (block pool, runner, scheduler), the server in `pyllama_paged.server`."""

from .api.llama import Llama
from .api.llama_compat import (LlamaCache, LlamaRAMCache, LlamaState, LlamaTokenizer, LogitsProcessor,
                               LogitsProcessorList, MinTokensLogitsProcessor, StoppingCriteria, StoppingCriteriaList)
from .api.llama_grammar import LlamaGrammar
from .engine import EngineLoop, RequestStream, SamplingParams
from .errors import ComputeError, ModelLoadError, NativeError, OutOfBlocksError, PagedError, RequestError
from ._version import __version__

__all__ = [
    "ComputeError",
    "EngineLoop",
    "Llama",
    "LlamaCache",
    "LlamaGrammar",
    "LlamaRAMCache",
    "LlamaState",
    "LlamaTokenizer",
    "LogitsProcessor",
    "LogitsProcessorList",
    "MinTokensLogitsProcessor",
    "ModelLoadError",
    "NativeError",
    "OutOfBlocksError",
    "PagedError",
    "RequestError",
    "RequestStream",
    "SamplingParams",
    "StoppingCriteria",
    "StoppingCriteriaList",
    "__version__",
]


def __getattr__(name: str):
    # llama-cpp-python's submodules by attribute, its low-level names refused with what to use
    from .api.llama_compat import root_attribute
    return root_attribute(__name__, name)
