"""The C contract itself (native/include/pyllama_paged.h and pyllama_paged_testing.h):
int32_t statuses split by sign, C enums read from the library rather than restated in
Python, the version check at import, test-only functions in the testing header, and the
functions the contract no longer has."""

import ctypes
import re
import subprocess
import sys
from importlib import metadata

import pytest

import pyllama_paged
from pyllama_paged import _native
from pyllama_paged._native import HEADER_PATH, LIBRARY_PATH, TESTING_HEADER_PATH, check_version, ffi, lib

HEADER = HEADER_PATH.read_text()
TESTING_HEADER = TESTING_HEADER_PATH.read_text()
TEST_ONLY = ("pp_pool_weaken_hash", "pp_attention_harness_create", "pp_attention_harness_destroy",
             "pp_attention_harness_write", "pp_attention_harness_read", "pp_attention_harness_paged",
             "pp_attention_harness_contiguous")
REMOVED = ("pp_kv_cache_create", "pp_seq_block_table")


def declared_functions(header: str) -> dict[str, str]:
    """name -> return type of every function a header declares."""
    text = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    return {m.group(2): m.group(1).strip()
            for m in re.finditer(r"^([A-Za-z_][\w ]*?[\s*]+)(pp_\w+)\(", text, flags=re.M)}


def test_statuses_split_by_sign():
    assert lib.PP_OK == _native.PP_OK == 0
    recoverable = (lib.PP_ERR_OUT_OF_BLOCKS, lib.PP_ERR_CAPACITY)
    errors = (lib.PP_ERR_INVALID, lib.PP_ERR_NO_MEMORY, lib.PP_ERR_COMPUTE)
    assert all(s > 0 for s in recoverable) and all(s < 0 for s in errors)
    assert len(set(recoverable + errors)) == 5
    assert (_native.PP_ERR_OUT_OF_BLOCKS, _native.PP_ERR_CAPACITY) == recoverable
    assert (_native.PP_ERR_INVALID, _native.PP_ERR_NO_MEMORY, _native.PP_ERR_COMPUTE) == errors


def test_the_library_returns_statuses_of_the_right_sign():
    out, seq = ffi.new("pp_block_pool **"), ffi.new("int32_t *")
    window = ffi.new("int32_t[]", [0])
    assert lib.pp_pool_create_grouped(2, 4, 1, window, out) == lib.PP_OK
    pool = out[0]
    try:
        tokens = ffi.new("int32_t[]", list(range(9)))   # 3 blocks of 4 > 2
        assert lib.pp_seq_create(pool, tokens, 9, seq, ffi.NULL) == lib.PP_ERR_OUT_OF_BLOCKS > 0
        assert lib.pp_seq_create(pool, tokens, 5, seq, ffi.NULL) == lib.PP_OK
        n = ffi.new("int32_t *")
        assert lib.pp_seq_tokens(pool, seq[0], ffi.NULL, 0, n) == lib.PP_ERR_CAPACITY > 0
        assert n[0] == 5   # the size needed, to retry with
        assert lib.pp_seq_free(pool, seq[0] + 1) == lib.PP_ERR_INVALID < 0
        assert "unknown sequence id" in _native.last_error()
    finally:
        lib.pp_pool_destroy(pool)


def test_every_status_is_a_fixed_width_int32():
    for header in (HEADER, TESTING_HEADER):
        functions = declared_functions(header)
        assert functions, "no function declarations found"
        plain = sorted(name for name, ret in functions.items() if re.search(r"\bint\b", ret))
        assert not plain, f"functions returning plain int: {plain}"
    for name in ("pp_seq_create", "pp_context_decode", "pp_sample", "pp_pool_weaken_hash",
                 "pp_attention_harness_paged"):
        assert ffi.typeof(getattr(lib, name)).result is ffi.typeof("int32_t")


def test_python_enums_come_from_the_library():
    from pyllama_paged.engine.kv.block_pool import BlockState
    from pyllama_paged.engine.pooling.encoder import _POOLING_IDS
    from pyllama_paged.engine.worker.model import PANEL_KERNELS
    from pyllama_paged.engine.worker.model_runner import ATTENTION_PATHS
    from pyllama_paged.gguf.config import ARCH_IDS

    assert [(s.name, s.value) for s in BlockState] == [
        ("FREE", lib.PP_BLOCK_FREE), ("USED", lib.PP_BLOCK_USED), ("CACHED", lib.PP_BLOCK_CACHED)]
    assert ARCH_IDS == {"llama": lib.PP_ARCH_LLAMA, "qwen2": lib.PP_ARCH_QWEN2, "qwen3": lib.PP_ARCH_QWEN3,
                        "gemma3": lib.PP_ARCH_GEMMA3, "bert": lib.PP_ARCH_BERT, "qwen3moe": lib.PP_ARCH_QWEN3MOE,
                        "gpt-oss": lib.PP_ARCH_GPT_OSS, "qwen35": lib.PP_ARCH_QWEN35,
                        "qwen35moe": lib.PP_ARCH_QWEN35MOE, "gemma4": lib.PP_ARCH_GEMMA4}
    assert ATTENTION_PATHS == {"kernel": lib.PP_ATTENTION_KERNEL, "gather": lib.PP_ATTENTION_GATHER}
    assert _POOLING_IDS == {"mean": lib.PP_POOLING_MEAN, "cls": lib.PP_POOLING_CLS, "last": lib.PP_POOLING_LAST}
    assert sorted(PANEL_KERNELS) == sorted([lib.PP_PANEL_KERNEL_NONE, lib.PP_PANEL_KERNEL_SCALAR,
                                            lib.PP_PANEL_KERNEL_AVXVNNI, lib.PP_PANEL_KERNEL_AVX512VNNI,
                                            lib.PP_PANEL_KERNEL_AVX2])


def test_the_library_is_the_package_version():
    version = ffi.string(lib.pp_version()).decode()
    assert version == pyllama_paged.__version__ == metadata.version("pyllama-paged")


def test_check_version_refuses_a_stale_library():
    check_version("1.2.3", "1.2.3")
    with pytest.raises(ImportError, match=r"'0\.0\.9'.*'1\.2\.3'.*stale build"):
        check_version("0.0.9", "1.2.3")


def test_import_fails_on_a_version_mismatch():
    # The import-time check itself: the binding re-run against a package version the
    # library was not built with.
    code = ("import importlib, pyllama_paged._version as v, pyllama_paged._native as n\n"
            "v.__version__ = '99.0.0'\n"
            "try:\n    importlib.reload(n)\nexcept ImportError as e:\n    print('refused:', e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert "refused:" in run.stdout and "stale build" in run.stdout and "'99.0.0'" in run.stdout


def test_test_only_functions_live_in_the_testing_header():
    main, testing = declared_functions(HEADER), declared_functions(TESTING_HEADER)
    for name in TEST_ONLY:
        assert name in testing and name not in main, name
        assert getattr(lib, name)   # bound, and exported by the same library
    assert '#include "pyllama_paged.h"' in TESTING_HEADER


def test_removed_functions_are_gone():
    so = ctypes.CDLL(str(LIBRARY_PATH))
    main = declared_functions(HEADER)
    for name in REMOVED:
        assert name not in main and not hasattr(so, name), name
    assert hasattr(so, "pp_pool_create")   # bench/kernels/pool_ops.c's
