"""The GPU builds compile wherever nvcc is (no GPU needed): our CUDA sources for every
architecture bench/build_ggml_cuda.sh targets by default, and libggml-python's CUDA backend
through that script. Both are slow (the second takes tens of minutes on 2 cores) and skip
without nvcc. The fast compile of our sources for sm_90 alone is
test_cuda_attention.py::test_the_cuda_source_compiles."""

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from pyllama_paged.testing.cuda_harness import build

ROOT = Path(__file__).resolve().parents[2]
CUDA_SOURCES = ROOT / "native" / "cuda"
BUILD_GGML_CUDA = ROOT / "bench" / "build_ggml_cuda.sh"

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def default_architectures() -> list[str]:
    """bench/_cuda_env.sh's CUDA_DEFAULT_ARCHS, as nvcc -arch names (sm_90, ...)."""
    out = subprocess.run(["bash", "-c", '. bench/_cuda_env.sh && echo "$CUDA_DEFAULT_ARCHS"'], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    return ["sm_" + a for a in out.split(";")]


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("arch", default_architectures())
def test_our_cuda_sources_compile_for_every_default_architecture(tmp_path, arch):
    # A kernel that builds for sm_90 can still use an instruction or a shared-memory size an
    # older consumer card lacks: compile for each card the GGML build targets.
    assert build(tmp_path, CUDA_SOURCES, arch).stat().st_size > 0


@pytest.mark.slow
@needs_nvcc
def test_libggml_python_builds_with_the_cuda_backend(tmp_path):
    env = {**os.environ, "JOBS": os.environ.get("JOBS", "2")}
    run = subprocess.run([str(BUILD_GGML_CUDA), str(tmp_path / "wheels"), "90"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    wheel = Path(run.stdout.strip().splitlines()[-1])
    # shared libraries only, so one wheel serves every Python 3 (the GPU machine's may differ)
    assert wheel.name.startswith("libggml_python-0.20.2.post1-py3-none-"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        cuda = [n for n in names if n.rsplit("/", 1)[-1].startswith("libggml-cuda.so")]
        assert cuda, f"no libggml-cuda.so in {wheel.name}: {names}"
        lib = tmp_path / "libggml-cuda.so"
        lib.write_bytes(z.read(cuda[0]))
    if shutil.which("readelf"):
        # The wheel must load the GPU machine's cuBLAS and driver, whatever stood in for them
        # at link time here (the stub keeps its real soname).
        dynamic = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
        for needed in ("libcudart.so", "libcublas.so", "libcuda.so.1"):
            assert needed in dynamic, f"{needed} missing from {cuda[0]}'s dependencies:\n{dynamic}"


@needs_nvcc
def test_the_build_script_refuses_an_architecture_nvcc_cannot_build(tmp_path):
    # checked before anything is downloaded or compiled: a typo fails in a second, not an hour
    run = subprocess.run([str(BUILD_GGML_CUDA), str(tmp_path), "90;52"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "cannot build architecture '52'" in run.stderr, run.stderr
    assert not any(tmp_path.iterdir())
