"""cffi binding of the native library: the one C header is the whole contract.

pyllama_paged.h is bound first, then pyllama_paged_testing.h (functions only tests and
benchmarks call, exported by the same library). Status codes and other C enums are read
from `lib` (lib.PP_OK, lib.PP_ERR_*, ...), never restated here.

PYLLAMA_PAGED_LIBRARY, when set, names the shared library to load instead of the one beside this module.
The library must report the package's version (pp_version()), else the import fails: a stale build.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import cffi

from . import _version
from .errors import ComputeError, NativeError, NativeMemoryError, OutOfBlocksError

_PACKAGE_DIR = Path(__file__).resolve().parent
HEADER_PATH = _PACKAGE_DIR / "include" / "pyllama_paged.h"
TESTING_HEADER_PATH = _PACKAGE_DIR / "include" / "pyllama_paged_testing.h"
# The header is always the installed one; the library may be another build of it
# (e.g. tests/test_asan.py's AddressSanitizer build).
LIBRARY_PATH = Path(os.environ.get("PYLLAMA_PAGED_LIBRARY") or _PACKAGE_DIR / "libpyllama_paged.so")


def _cdef_source(header: str) -> str:
    """The header's declarations, minus comments, preprocessor lines and the C++ guard."""
    header = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    # The C++ guard is the only `extern "C" {` line and the only bare `}` line
    # (struct and enum bodies close with `} name;` or `};`).
    keep = [
        line
        for line in header.splitlines()
        if not line.lstrip().startswith("#") and line.strip() not in ('extern "C" {', "}")
    ]
    return "\n".join(keep)


def _load():
    if not LIBRARY_PATH.exists():
        if os.environ.get("PYLLAMA_PAGED_LIBRARY"):
            raise ImportError(f"PYLLAMA_PAGED_LIBRARY names {LIBRARY_PATH}, which does not exist")
        raise ImportError(
            f"pyllama-paged's native library is missing at {LIBRARY_PATH}: "
            "install the package with `pip install .` rather than importing the source tree"
        )
    ffi = cffi.FFI()
    ffi.cdef(_cdef_source(HEADER_PATH.read_text()))
    ffi.cdef(_cdef_source(TESTING_HEADER_PATH.read_text()))
    return ffi, ffi.dlopen(str(LIBRARY_PATH))


def check_version(library_version: str, package_version: str) -> None:
    """Raise ImportError unless the loaded library was built from this package's version."""
    if library_version != package_version:
        raise ImportError(
            f"pyllama-paged's native library {LIBRARY_PATH} is version {library_version!r}, but the "
            f"Python package is version {package_version!r}: the library is a stale build. Rebuild and "
            "reinstall the package (`pip install .`)"
            + (", or point PYLLAMA_PAGED_LIBRARY at a matching build" if os.environ.get("PYLLAMA_PAGED_LIBRARY")
               else ""))


ffi, lib = _load()
check_version(ffi.string(lib.pp_version()).decode("utf-8", "replace"), _version.__version__)

# Status codes (enum pp_status): 0 success, > 0 recoverable (retry after freeing blocks or with a
# bigger buffer), < 0 an error. Re-exported for callers that compare statuses.
PP_OK = lib.PP_OK
PP_ERR_OUT_OF_BLOCKS = lib.PP_ERR_OUT_OF_BLOCKS
PP_ERR_CAPACITY = lib.PP_ERR_CAPACITY
PP_ERR_INVALID = lib.PP_ERR_INVALID
PP_ERR_NO_MEMORY = lib.PP_ERR_NO_MEMORY
PP_ERR_COMPUTE = lib.PP_ERR_COMPUTE

GGML_LOG_DEBUG, GGML_LOG_WARN = 1, 3   # ggml_log_level values
# GGML's default logger prints debug lines (one per repacked weight) to stderr.
lib.pp_set_ggml_log_level(GGML_LOG_WARN)


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
