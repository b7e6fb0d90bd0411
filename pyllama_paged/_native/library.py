"""Loading the native library: the headers' declarations bound with cffi, the shared
library opened, and the check that it was built from this package's version.

pyllama_paged.h is bound first, then pyllama_paged_testing.h (functions only tests and
benchmarks call, exported by the same library).

PYLLAMA_PAGED_LIBRARY, when set, names the shared library to load instead of the one the
package installs (beside the package's modules). A source tree imported in place (a checkout's
root first on sys.path, as `python -m bench.engine.batched` puts it) has no build of its own:
it loads the installed package's, which the version check below holds to the same version.
When there is none in this Python, the ImportError says so and gives the install command.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import cffi

_HERE = Path(__file__).resolve().parent.parent


def _installed_dir() -> Path | None:
    """The installed pyllama-paged's package folder in this Python's environment (None: none)."""
    try:
        from importlib import metadata

        return Path(metadata.distribution("pyllama-paged").locate_file("pyllama_paged")).resolve()
    except (ImportError, OSError, ValueError):   # PackageNotFoundError is an ImportError
        return None


def _native_dir() -> Path:
    """Where the library and its headers are: beside this package's modules, or for a source
    tree without them, beside the installed package's (the same path when none is installed)."""
    if (_HERE / "libpyllama_paged.so").exists():
        return _HERE
    installed = _installed_dir()
    return installed if installed is not None and (installed / "libpyllama_paged.so").exists() else _HERE


def _missing_library_message() -> str:
    """Why no library was found, and what to do: the first import from a fresh clone lands here."""
    installed = _installed_dir()
    if (_HERE.parent / "pyproject.toml").exists() and installed != _HERE:
        # a checkout's pyllama_paged shadows any installed one (the current directory is first on
        # sys.path); it borrows the installed package's build, and this Python has none
        where = (f"the pyllama-paged installed at {installed} has no native library either" if installed
                 else "no pyllama-paged is installed")
        return (f"pyllama_paged was imported from the source tree {_HERE} (the current directory or PYTHONPATH "
                f"puts it before any installed one), which has no native build of its own; it uses the installed package's, but "
                f"{where} in this Python ({sys.executable}). Install it with this Python: "
                f"`{sys.executable} -m pip install {_HERE.parent}` (the README's `pip install .` inside the "
                "activated virtual environment), then run from here or from any other directory")
    return (f"pyllama-paged's native library is missing at {LIBRARY_PATH}: the installed package is incomplete; "
            f"reinstall it with this Python (`{sys.executable} -m pip install --force-reinstall pyllama-paged` "
            "or `pip install .` from the checkout)")


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
        raise ImportError(_missing_library_message())
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
