"""cffi binding of the native library: the one C header is the whole contract.

`library` binds the headers and opens the library, `status` turns status codes into
exceptions (`check`), `ggml_log` quiets GGML's logger, `handle` frees what a wrapper owns. Status codes and other C enums are
read from `lib` (lib.PP_OK, lib.PP_ERR_*, ...), never restated here.

The library must report the package's version (pp_version()), else the import fails: a stale build.
"""

from __future__ import annotations

from .. import _version
from .library import HEADER_PATH, LIBRARY_PATH, TESTING_HEADER_PATH, check_version, ffi, lib, library_version

# Checked here, by the package's own import, so that re-importing it (importlib.reload) checks again.
check_version(library_version(), _version.__version__)

from .ggml_log import GGML_LOG_DEBUG, GGML_LOG_WARN  # noqa: E402  (after the version check)
from .handle import Closing, NativeHandle  # noqa: E402
from .status import (  # noqa: E402
    PP_ERR_CAPACITY,
    PP_ERR_COMPUTE,
    PP_ERR_INVALID,
    PP_ERR_NO_MEMORY,
    PP_ERR_OUT_OF_BLOCKS,
    PP_OK,
    check,
    last_error,
)

__all__ = [
    "HEADER_PATH", "LIBRARY_PATH", "TESTING_HEADER_PATH", "check_version", "ffi", "lib", "library_version",
    "GGML_LOG_DEBUG", "GGML_LOG_WARN", "Closing", "NativeHandle",
    "PP_OK", "PP_ERR_OUT_OF_BLOCKS", "PP_ERR_CAPACITY", "PP_ERR_INVALID", "PP_ERR_NO_MEMORY", "PP_ERR_COMPUTE",
    "check", "last_error",
]
