"""The library runs on any x86-64 CPU: it is built for the x86-64 baseline and
uses AVX2 / AVX-512 / VNNI only in variants picked at run time."""

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
DISPATCHED_SUFFIXES = ("_avx2", "_avx512", "_avx512vnni", "_avxvnni")
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
    assert any(f"attention={v}" in info for v in ("avx512", "avx2", "generic"))


@x86_only
@pytest.mark.parametrize("variant", ["generic", "avx2"])
def test_each_variant_passes_the_kernel_tests(variant):
    """The variants a CPU of this machine would not pick (PYLLAMA_PAGED_KERNELS forces one) pass too."""
    if variant == "avx2" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 here")
    env = {**os.environ, "PYLLAMA_PAGED_KERNELS": variant}
    probe = subprocess.run([sys.executable, "-c", "from pyllama_paged._native import ffi, lib; "
                            "print(ffi.string(lib.pp_ggml_build_info()).decode())"],
                           capture_output=True, text=True, env=env, check=True, cwd="/")
    assert f"attention={variant}" in probe.stdout
    # from / so that the installed package is imported, not the source tree
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-c", str(TESTS_DIR.parent / "pyproject.toml"),
                          str(TESTS_DIR / "test_paged_attention.py")],
                         capture_output=True, text=True, env=env, cwd="/")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
