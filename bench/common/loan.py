"""A GPU loan's plumbing for bench/device_bench.py: the carry bench/gpu_carry.sh builds (one xz file
unpacked into a folder: site/ for PYTHONPATH, with the CUDA GGML under site/libggml/lib, and
llama.cpp's tools in llama.cpp/bin), the environment that runs on it, and the results packed into
one file (a loan's command brings back at most 8 files)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
CARRY = BENCH / ".carry" / "carry.tar.xz"
UNPACKED = BENCH / ".carry" / "unpacked"
MAX_FILES_BACK = 8
RESULTS_TAR = "device_bench.tar.xz"
# Set in the process that runs on an unpacked carry: its root.
CARRY_ENV = "PYLLAMA_DEVICE_BENCH_CARRY"
LLAMA_CPP_TOOLS = ("llama-server", "llama-batched-bench", "llama-bench")
# The GPU machine's Python, and the modules its image lacks, which the carry brings.
CARRIED_PYTHON = (3, 12)
CARRIED_MODULES = ("cffi", "gguf", "fastapi", "uvicorn", "llguidance", "openai")


def unpack_carry(carry: Path, into: Path) -> Path:
    """Unpack the carry into `into` (made fresh); its root."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(carry, "r:xz") as tar:
        tar.extractall(into, filter="tar")
    return into


def ggml_lib_dir(site: Path) -> Path:
    """The carried GGML's library folder under site: lib64 as PyPI's wheel lays it out, else
    lib as a build from the sdist does."""
    ggml = site / "libggml"
    return ggml / "lib64" if (ggml / "lib64").is_dir() else ggml / "lib"


def carry_env(root: Path, env: dict | None = None) -> dict:
    """env (default os.environ) with the carry's site first on PYTHONPATH and its GGML first on
    LD_LIBRARY_PATH (llama.cpp's tools find it by their rpath too)."""
    env = dict(os.environ if env is None else env)
    site = root / "site"
    libs = ggml_lib_dir(site)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["LD_LIBRARY_PATH"] = ":".join([str(libs)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p])
    env[CARRY_ENV] = str(root)
    return env


def carry_problems(root: Path, need_cuda: bool = True) -> list[str]:
    """What the unpacked carry lacks for a loan's run (empty: nothing)."""
    site = root / "site"
    problems = []
    if not (site / "pyllama_paged" / "libpyllama_paged.so").is_file():
        problems.append("site/pyllama_paged/libpyllama_paged.so is missing (our library)")
    cuda = ggml_lib_dir(site) / "libggml-cuda.so"
    if need_cuda and not cuda.exists():
        problems.append(f"{cuda.relative_to(root)} is missing: the carried GGML has no CUDA backend")
    for tool in LLAMA_CPP_TOOLS:
        if not os.access(root / "llama.cpp" / "bin" / tool, os.X_OK):
            problems.append(f"llama.cpp/bin/{tool} is missing")
    if sys.version_info[:2] != CARRIED_PYTHON:   # its binary modules are built for the GPU machine's Python
        problems += [f"site/{m} is missing" for m in CARRIED_MODULES if not (site / m).is_dir()]
        return problems
    probe = subprocess.run([sys.executable, "-c", "import " + ", ".join(CARRIED_MODULES)], env=carry_env(root),
                           capture_output=True, text=True)
    if probe.returncode:
        problems.append("the carried modules do not import: " + (probe.stderr.strip().splitlines() or ["?"])[-1])
    return problems


def run_on_carry(carry: Path, module: str, argv: list[str]) -> None:
    """Run `python -m module argv` again on the unpacked carry (once: a process already on one
    returns); nothing happens without a carry file."""
    if os.environ.get(CARRY_ENV) or not carry.is_file():
        return
    root = unpack_carry(carry, UNPACKED)
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], carry_env(root))


def carried_llama_cpp_bin() -> Path | None:
    """llama.cpp's tools in the carry this process runs on (None: not on a carry)."""
    root = os.environ.get(CARRY_ENV)
    return Path(root) / "llama.cpp" / "bin" if root else None


def tar_results(out_dir: Path, dest: Path) -> Path:
    """Pack the results folder into dest/RESULTS_TAR; refuse when dest would hold more files than
    a loan brings back."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / RESULTS_TAR
    with tarfile.open(path, "w:xz") as tar:
        tar.add(out_dir, arcname=out_dir.name)
    files = [p for p in dest.rglob("*") if p.is_file()]
    if len(files) > MAX_FILES_BACK:
        raise RuntimeError(f"{dest} holds {len(files)} files: a loan brings back at most {MAX_FILES_BACK}")
    return path
