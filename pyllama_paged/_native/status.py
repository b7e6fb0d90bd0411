"""The one error funnel: a native status code becomes a `PagedError` subclass carrying
the calling thread's C error text."""

from __future__ import annotations

from ..errors import ComputeError, NativeError, NativeMemoryError, OutOfBlocksError
from .library import ffi, lib

# Status codes (enum pp_status): 0 success, > 0 recoverable (retry after freeing blocks or with a
# bigger buffer), < 0 an error. Re-exported for callers that compare statuses.
PP_OK = lib.PP_OK
PP_ERR_OUT_OF_BLOCKS = lib.PP_ERR_OUT_OF_BLOCKS
PP_ERR_CAPACITY = lib.PP_ERR_CAPACITY
PP_ERR_INVALID = lib.PP_ERR_INVALID
PP_ERR_NO_MEMORY = lib.PP_ERR_NO_MEMORY
PP_ERR_COMPUTE = lib.PP_ERR_COMPUTE


def last_error() -> str:
    """The calling thread's last error text from the native library."""
    return ffi.string(lib.pp_last_error()).decode("utf-8", "replace")


def check(status: int, what: str) -> None:
    """Raise the exception matching a native status code, with the C error text."""
    if status == PP_OK:
        return
    message = f"{what}: {last_error()}"
    if status == PP_ERR_OUT_OF_BLOCKS:
        raise OutOfBlocksError(message)
    if status == PP_ERR_NO_MEMORY:
        raise NativeMemoryError(message, status)
    if status == PP_ERR_COMPUTE:
        raise ComputeError(message, status)
    raise NativeError(message, status)
