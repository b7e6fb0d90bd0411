"""Loading the native library: the headers' declarations bound with cffi, the shared
library opened, and the check that it was built from this package's version.

pyllama_paged.h is bound first, then pyllama_paged_testing.h (functions only tests and
benchmarks call, exported by the same library).

PYLLAMA_PAGED_LIBRARY, when set, names the shared library to load instead of the one the
package installs (beside the package's modules). A source tree imported in place (a checkout's
root first on sys.path, as `python -m bench.engine.batched` puts it) has no build of its own:
it loads the installed package's, which the version check below holds to the same version.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import cffi

def _native_dir() -> Path:
    """Where the library and its headers are: beside this package's modules, or for a source
    tree without them, beside the installed package's (the same path when none is installed)."""
    here = Path(__file__).resolve().parent.parent
    if (here / "libpyllama_paged.so").exists():
        return here
    try:
        from importlib import metadata

        installed = Path(metadata.distribution("pyllama-paged").locate_file("pyllama_paged"))
    except (ImportError, OSError, ValueError):   # PackageNotFoundError is an ImportError
        return here
    return installed if (installed / "libpyllama_paged.so").exists() else here


# CMakeLists.txt installs the library and the headers at the package's top, not in this folder.
_PACKAGE_DIR = _native_dir()
HEADER_PATH = _PACKAGE_DIR / "include" / "pyllama_paged.h"
TESTING_HEADER_PATH = _PACKAGE_DIR / "include" / "pyllama_paged_testing.h"
# The header is always the installed one; the library may be another build of it
# (e.g. tests/native/test_asan.py's AddressSanitizer build).
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


def library_version() -> str:
    """The version the loaded library was built from (pp_version())."""
    return ffi.string(lib.pp_version()).decode("utf-8", "replace")
