"""pyllama_paged/testing/synthetic_gguf.py at full size, and against llama.cpp (slow): every preset
has its real model's parameter count and llama.cpp's llama-bench loads and runs it; llama-server
tokenizes each preset's chat prompt and other texts as our engine does. The llama.cpp parts need its tools,
built by bench/build_llama_cpp.sh (or LLAMA_CPP_BIN naming their directory), and skip without them."""

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from pyllama_paged.testing import synthetic_gguf, synthetic_presets
from pyllama_paged.testing.serving import free_port, stop_server, wait_healthy

pytestmark = pytest.mark.slow

CHECKOUT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello world! What is the capital of France?\n\nAnswer in one word."}]
# besides the chat prompt: numbers, non-ASCII letters and symbols, whitespace runs, code
TEXTS = ["In 1789, 12345 people... naïve café 東京 🙂", "def f(x):\n    return x  +  1\n\n\n\tdone"]


def llama_cpp_tool(name: str) -> Path:
    """The built llama.cpp tool's path; skips the test when it has not been built."""
    bin_dir = Path(os.environ.get("LLAMA_CPP_BIN", CHECKOUT / "bench" / ".llama.cpp" / "build" / "bin"))
    if not (bin_dir / name).is_file():
        pytest.skip(f"{name} is not built (bench/build_llama_cpp.sh builds it)")
    return bin_dir / name


# Presets whose full file would not fit beside CI's other work (a 30B MoE is ~18.6 GB on a
# 24 GiB machine) run only when asked: PYLLAMA_PAGED_BIG_PRESETS=1.
BIG_PARAMS = 10e9


@pytest.mark.parametrize("name", list(synthetic_presets.PRESETS))
def test_full_size_has_the_real_parameter_count_and_llama_cpp_runs_it(name, tmp_path):
    preset = synthetic_presets.get(name)
    n_params = preset.real_params or preset.approx_params
    if n_params > BIG_PARAMS and not os.environ.get("PYLLAMA_PAGED_BIG_PRESETS"):
        pytest.skip(f"{name}: {n_params / 1e9:.1f}B parameters at full size (PYLLAMA_PAGED_BIG_PRESETS=1)")
    bench_tool = llama_cpp_tool("llama-bench")   # before writing GBs that nothing would read
    path = tmp_path / preset.file_name
    try:
        info = synthetic_gguf.write(path, preset)
        if preset.real_params:
            # the text model's count: only Gemma 3 4B differs, its embedding having the
            # tokenizer's 262144 rows where the real one pads to 262208
            assert info["n_params"] == pytest.approx(preset.real_params, rel=1e-3)
        bench = subprocess.run([str(bench_tool), "-m", str(path), "-p", "16", "-n", "4",
                                "-t", "2", "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=1200)
        assert bench.returncode == 0, bench.stderr[-2000:]
        runs = json.loads(bench.stdout)
        assert {r["n_prompt"] for r in runs} == {16, 0} and all(r["avg_ts"] > 0 for r in runs)
    finally:
        path.unlink(missing_ok=True)   # a few GB each: not left for pytest's kept tmp dirs


def llama_server_tokens(binary: Path, model: Path, texts: list[str], log: Path) -> list[list[int]]:
    """The tokens llama-server gives each text, BOS as the model asks and control tokens parsed."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(binary), "-m", str(model), "--port", str(port), "-c", "256", "-t", "2"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, "/health", timeout=300, log=log)
        return [httpx.post(url + "/tokenize", json={"content": text, "add_special": True, "parse_special": True},
                           timeout=60).json()["tokens"] for text in texts]
    finally:
        stop_server(proc)


@pytest.mark.parametrize("name", list(synthetic_presets.PRESETS))
def test_llama_cpp_tokenizes_as_we_do(name, tmp_path):
    from pyllama_paged import Llama

    server = llama_cpp_tool("llama-server")
    info = synthetic_gguf.write(tmp_path / "small.gguf", synthetic_presets.shrink(synthetic_presets.get(name)))
    llm = Llama(model_path=info["path"], paged=True, n_ctx=256, n_threads=2, verbose=False)
    texts = [str(llm.chat_template.render(MESSAGES))] + TEXTS
    ours = [llm.tokenize(text.encode(), special=True) for text in texts]
    assert llama_server_tokens(server, Path(info["path"]), texts, tmp_path / "server.log") == ours
