"""pyllama-paged: quantized GGUF models on GGML with a paged KV cache."""

from .engine.block_pool import BlockInfo, BlockPool, BlockState, PoolStats
from .engine.llm_engine import LLMEngine, RequestOutput
from .engine.loop import EngineLoop, RequestStream
from .engine.model import Model
from .engine.model_runner import ModelRunner
from .engine.sampler import SamplingParams
from .engine.scheduler import SchedulerConfig
from .errors import ComputeError, ModelLoadError, NativeError, OutOfBlocksError, PagedError
from .llama import Llama
from ._version import __version__

__all__ = [
    "BlockInfo",
    "BlockPool",
    "BlockState",
    "ComputeError",
    "EngineLoop",
    "LLMEngine",
    "Llama",
    "Model",
    "ModelLoadError",
    "ModelRunner",
    "NativeError",
    "OutOfBlocksError",
    "PagedError",
    "PoolStats",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "SchedulerConfig",
]
