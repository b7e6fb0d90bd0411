"""The native library under AddressSanitizer (slow: builds the library once more).

The library is built from this source tree with ``-DPP_SANITIZE=address`` (against
the same installed libggml-python GGML as the package) into a cached build directory,
then a child Python with libasan preloaded loads it through PYLLAMA_PAGED_LIBRARY and
drives the paths that write native result buffers at their bounds: beam search at
the maximum width (2 x width top entries a row), a completion with 20 logprobs, n=4
sampling and an embedding; and a hybrid's sequences (their state slots read and written in
the step's graph, forked). Any ASan report fails the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The child's work: arguments are the model path and the libggml-python directory.
SCRIPT = r"""
import sys
from pathlib import Path
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
import pyllama_paged
from pyllama_paged import _native
from pyllama_paged.engine import MAX_BEAM_WIDTH

model_path, ggml_dir = sys.argv[1], Path(sys.argv[2]).resolve()
write_tiny_model(model_path, "gemma3", weight_type="q8_0")
# n_seq_max: KV pages for MAX_BEAM_WIDTH beams of two prompts
llm = pyllama_paged.Llama(model_path=model_path, n_ctx=256, n_seq_max=8, n_threads=2)
maps = Path("/proc/self/maps").read_text().split()
mapped = {{Path(p).resolve() for p in maps if p.startswith("/") and ".so" in p}}
assert Path(_native.LIBRARY_PATH).resolve() in mapped, "the ASan build is not the library loaded"
ggml = {{p for p in mapped if p.name.startswith("libggml")}}
lib_dir = ggml_dir / "lib64" if (ggml_dir / "lib64").is_dir() else ggml_dir / "lib"
assert ggml and all(p.parent == lib_dir for p in ggml), f"GGML loaded from elsewhere: {{ggml}}"

beams = llm.generate_batch(["The quick brown fox", "Once upon a time"], max_tokens=6, beam_width=MAX_BEAM_WIDTH)
assert [len(b) for b in beams] == [MAX_BEAM_WIDTH] * 2, beams
out = llm.create_completion("hello world", max_tokens=4, logprobs=20, temperature=0.7, seed=3)
assert out["choices"][0]["logprobs"]["top_logprobs"], out
samples = llm.generate_batch(["a b c", "x y z"], max_tokens=6, n=4, seed=7)
assert [len(s) for s in samples] == [4, 4], samples
vec = llm.embed("hello", pooling="mean")
assert len(vec) == llm.n_embd(), len(vec)
llm.close()

# a hybrid: its state pool read and written by slot in the step's graph, forks copying slots
from pyllama_paged.testing.reference.tiny_qwen35 import write_tiny_qwen35
hybrid = pyllama_paged.Llama(model_path=write_tiny_qwen35(model_path + ".qwen35", "qwen35moe"), n_ctx=128,
                             n_seq_max=4, n_threads=2)
samples = hybrid.generate_batch(["a b c", "x y z w v"], max_tokens=5, n=2, seed=7)
assert [len(s) for s in samples] == [2, 2], samples
hybrid.close()
print("asan-run-ok", MAX_BEAM_WIDTH)
"""


def libasan_path() -> str | None:
    """gcc's libasan.so, or None (gcc echoes the bare name back when it has none)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    found = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


def libggml_dir() -> Path:
    """Where the installed libggml-python lives: the GGML the package loads."""
    import libggml
    return Path(libggml.__file__).resolve().parent


def build_asan_library(source: Path, build: Path) -> Path:
    """Configure and build source's library with -DPP_SANITIZE=address in build (incremental)."""
    # the wheel's libraries are in lib64, a build from the sdist's in lib
    ggml_cmake = next(libggml_dir() / d / "cmake" / "ggml" for d in ("lib64", "lib") if (libggml_dir() / d).is_dir())
    configure = ["cmake", "-S", str(source), "-B", str(build), "-DPP_SANITIZE=address",
                 "-DCMAKE_BUILD_TYPE=Release", f"-Dggml_DIR={ggml_cmake}",
                 f"-DPython_EXECUTABLE={sys.executable}", f"-DCMAKE_C_COMPILER={shutil.which('gcc')}"]
    jobs = str(len(os.sched_getaffinity(0)))
    for cmd in (configure, ["cmake", "--build", str(build), "--target", "pyllama_paged", "--parallel", jobs]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    library = build / "libpyllama_paged.so"
    assert library.exists(), library
    return library


def run_under_asan(library: Path, libasan: str, workdir: Path) -> subprocess.CompletedProcess:
    """The child Python on `library` with libasan preloaded."""
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               PYLLAMA_PAGED_LIBRARY=str(library))
    script = workdir / "asan_child.py"
    script.write_text(SCRIPT.format())   # the doubled braces are the script's own
    return subprocess.run([sys.executable, str(script), str(workdir / "tiny-gemma3.gguf"), str(libggml_dir())],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_native_library_is_clean_under_address_sanitizer(request, tmp_path_factory):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed: cannot build the ASan library")
    libasan = libasan_path()
    if libasan is None:
        pytest.skip("libasan is not available (gcc -print-file-name=libasan.so finds none)")
    from pyllama_paged._native import HEADER_PATH
    source_header = REPO / "native" / "include" / "pyllama_paged.h"
    # Python lays out the structs from the installed header: a build from a different one means nothing.
    assert HEADER_PATH.read_bytes() == source_header.read_bytes(), \
        f"the installed header {HEADER_PATH} differs from {source_header}: reinstall the package"
    cache = getattr(request.config, "cache", None)
    build = cache.mkdir("asan-build") if cache is not None else tmp_path_factory.mktemp("asan-build")
    library = build_asan_library(REPO, Path(build))
    done = run_under_asan(library, libasan, tmp_path_factory.mktemp("asan-run"))
    assert "ERROR: AddressSanitizer" not in done.stderr, done.stderr[-8000:]
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-8000:]}"
    assert "asan-run-ok" in done.stdout
