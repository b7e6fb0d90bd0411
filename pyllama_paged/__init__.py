"""pyllama-paged: quantized GGUF models on GGML with a paged KV cache."""

from .engine.block_pool import BlockInfo, BlockPool, BlockState, PoolStats
from .engine.llm_engine import LLMEngine, RequestOutput
from .engine.loop import EngineLoop, RequestStream
from .engine.model import Model
from .engine.model_runner import ModelRunner
from .engine.sampler import SamplingParams
from .engine.scheduler import SchedulerConfig
from .errors import ComputeError, ModelLoadError, NativeError, OutOfBlocksError, PagedError, RequestError
from .llama import Llama
from .llama_compat import (LlamaCache, LlamaRAMCache, LlamaState, LlamaTokenizer, LogitsProcessor,
                           LogitsProcessorList, MinTokensLogitsProcessor, StoppingCriteria, StoppingCriteriaList)
from .llama_grammar import LlamaGrammar
from ._version import __version__

__all__ = [
    "BlockInfo",
    "BlockPool",
    "BlockState",
    "ComputeError",
    "EngineLoop",
    "LLMEngine",
    "Llama",
    "LlamaCache",
    "LlamaGrammar",
    "LlamaRAMCache",
    "LlamaState",
    "LlamaTokenizer",
    "LogitsProcessor",
    "LogitsProcessorList",
    "MinTokensLogitsProcessor",
    "Model",
    "ModelLoadError",
    "ModelRunner",
    "NativeError",
    "OutOfBlocksError",
    "PagedError",
    "PoolStats",
    "RequestError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "SchedulerConfig",
    "StoppingCriteria",
    "StoppingCriteriaList",
]
