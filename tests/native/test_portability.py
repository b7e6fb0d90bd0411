"""The library runs on any x86-64 CPU: it is built for the x86-64 baseline and
uses AVX2 only in the attention math variant picked at run time."""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_paged._native import LIBRARY_PATH, ffi, lib

TESTS_DIR = Path(__file__).resolve().parent
# Functions chosen at run time by CPU feature: the AVX2 math, the VNNI panel GEMMs.
DISPATCHED_SUFFIXES = ("_avx2", "_avx512vnni", "_avxvnni")
x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only")


@x86_only
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_only_the_avx2_variant_uses_avx_instructions():
    # A VEX/EVEX instruction (v-prefixed mnemonics, ymm/zmm registers) in any
    # other function would be a SIGILL on a CPU without AVX.
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(LIBRARY_PATH)],
                             capture_output=True, text=True, check=True).stdout
    function, offenders, avx2_functions = None, set(), set()
    for line in listing.splitlines():
        if line.endswith(">:"):
            function = line.split("<", 1)[1][:-2]
            continue
        fields = line.split("\t")
        if len(fields) < 2 or not fields[1]:
            continue
        mnemonic = fields[1].split()[0]
        if mnemonic.startswith("v") or "%ymm" in line or "%zmm" in line:
            name = function.split(".")[0]   # gcc's .part.0 / .cold clones keep the name
            (avx2_functions if name.endswith(DISPATCHED_SUFFIXES) else offenders).add(function)
    assert not offenders, f"AVX instructions outside the run-time dispatched variants: {sorted(offenders)}"
    assert avx2_functions, "the AVX2 variant is missing from the build"


def test_build_info_names_the_attention_variant():
    info = ffi.string(lib.pp_ggml_build_info()).decode()
    assert "attention=avx2" in info or "attention=generic" in info


@x86_only
def test_the_portable_variant_passes_the_kernel_tests():
    env = {**os.environ, "PYLLAMA_PAGED_KERNELS": "generic"}
    probe = subprocess.run([sys.executable, "-c", "from pyllama_paged._native import ffi, lib; "
                            "print(ffi.string(lib.pp_ggml_build_info()).decode())"],
                           capture_output=True, text=True, env=env, check=True, cwd="/")
    assert "attention=generic" in probe.stdout
    # from / so that the installed package is imported, not the source tree
    # the sampler's scalar passes too, on its small rows (a vocabulary-sized row is slow without AVX2)
    for tests in (["test_paged_attention.py"],
                  ["test_sampling.py", "-k", "reference_distribution or fewer_live or logprobs or seed"]):
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "-c", str(TESTS_DIR.parents[1] / "pyproject.toml"), str(TESTS_DIR / tests[0]), *tests[1:]],
                             capture_output=True, text=True, env=env, cwd="/")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
