"""pyllama-paged: quantized GGUF models on GGML with a paged KV cache."""

from .block_pool import BlockInfo, BlockPool, BlockState, PoolStats
from .errors import ModelLoadError, NativeError, OutOfBlocksError, PagedError

__version__ = "0.1.0"

__all__ = [
    "BlockInfo",
    "BlockPool",
    "BlockState",
    "ModelLoadError",
    "NativeError",
    "OutOfBlocksError",
    "PagedError",
    "PoolStats",
]
