"""The two sides a benchmark compares: llama.cpp's tools (built, found, started) and our own
server started the same way, in the same KV bytes.

llama.cpp's tools come from bench/build_llama_cpp.sh (the llama-cpp-python 0.3.36 sdist's
bundled source, built under bench/.llama.cpp/; `--cuda` for a GPU build); the script prints
the folder of the binaries on its last line.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common.options import add_options
from bench.common.report import BENCH_DIR

# pyllama_paged is imported inside the functions: device_bench.py imports this module before it
# has put pip's CUDA libraries on the loader's path (and runs itself again).

BUILD_LLAMA_CPP = BENCH_DIR / "build_llama_cpp.sh"
# Where build_llama_cpp.sh leaves the CPU build: the default of scripts that do not build it.
LLAMA_CPP_BIN = BENCH_DIR / ".llama.cpp" / "build" / "bin"
# The KV bytes a server is given when no llama-server ran to size them (-np 4 -c 8192 of the
# default model).
DEFAULT_KV_BYTES = 84 * 1024 * 1024


# ---- llama.cpp's tools ----------------------------------------------------------------

def llama_cpp_tools(cuda: bool = False, env: dict | None = None) -> Path:
    """The folder of llama.cpp's binaries, built by bench/build_llama_cpp.sh on first use."""
    out = subprocess.run([str(BUILD_LLAMA_CPP), *(["--cuda"] if cuda else [])], env=env, check=True,
                         capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def llama_cpp_tool(name: str, given: str | None = None) -> str:
    """The path of llama.cpp's tool `name`: `given`, else the one build_llama_cpp.sh builds."""
    return given if given else str(llama_cpp_tools() / name)


def gpu_layers_flag(n_gpu_layers: int) -> str:
    """Our n_gpu_layers as llama.cpp's -ngl value (its -1 is "auto", ours "all")."""
    return "all" if n_gpu_layers == -1 else str(n_gpu_layers)


def kv_buffer_mib(log: Path) -> list[float]:
    """The KV buffer sizes llama-server's log reports, one per cache (global and SWA layers)."""
    # "llama_kv_cache:        CPU KV buffer size =    48.00 MiB" ("CUDA0 KV buffer size" on a GPU)
    return [float(x) for x in re.findall(r"KV buffer size\s*=\s*([0-9.]+) MiB", log.read_text())]


def launch_llama_server(binary: str, model: str, flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """llama-server on a free loopback port with `flags`, its output in `log`; (process, url) once healthy."""
    from pyllama_paged.testing.serving import free_port, stop_server, wait_healthy

    port = free_port()
    proc = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), *flags],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, "/health", log=log)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


def parse_peer(spec: str) -> tuple[int, bool]:
    """'np16-kvu' -> (16, True): llama-server's slot count and unified-cache flag."""
    m = re.fullmatch(r"np(\d+)(-kvu)?", spec.strip())
    if not m:
        raise ValueError(f"llama-server configuration {spec!r}: expected npN or npN-kvu")
    return int(m.group(1)), bool(m.group(2))


def peer_label(n_parallel: int, kvu: bool) -> str:
    """How tables name a llama-server configuration."""
    return f"llama-server -np {n_parallel}" + (" -kvu" if kvu else "")


def start_llama_server(binary: str, model: str, args, n_parallel: int, kvu: bool, log: Path, extra=()):
    """llama-server as the chat benchmarks run it (args: add_server_arguments'); (process, url,
    model name, KV buffer bytes read from its log)."""
    from pyllama_paged.testing.serving import stop_server

    flags = ["-t", str(args.threads), "-c", str(args.ctx), "-np", str(n_parallel), "-lv", "4",
             "-ngl", gpu_layers_flag(args.gpu_layers), *(["-kvu"] if kvu else []), *extra]
    proc, url = launch_llama_server(binary, model, flags, log)
    mib = kv_buffer_mib(log)
    if not mib:
        stop_server(proc)
        raise RuntimeError(f"no KV buffer size in {log}")
    return proc, url, "default", int(sum(mib) * 1024 * 1024)


def peer_chat_template(metadata: dict, work: Path) -> list[str]:
    """llama-server's arguments for a GGUF without a chat template: the built-in template ours
    falls back to, as a file (llama-server's own fallback is ChatML: other prompts for the model)."""
    from pyllama_paged.tokenizer.chat_template import builtin_template

    if metadata.get("tokenizer.chat_template"):
        return []
    path = work / "chat_template.jinja"
    path.write_text(builtin_template(metadata.get("general.architecture"), metadata.get("tokenizer.ggml.tokens")),
                    encoding="utf-8")
    return ["--chat-template-file", str(path)]


# ---- our server -------------------------------------------------------------------------

def our_cli() -> str:
    """The `pyllama-paged` entry point: on PATH, else next to this interpreter (a venv not activated)."""
    beside = Path(sys.executable).with_name("pyllama-paged")
    return shutil.which("pyllama-paged") or (str(beside) if beside.exists() else "pyllama-paged")


def our_bytes_per_token(model: str | None) -> int:
    """KV bytes one token takes in our paged pool for `model` (None: the default model)."""
    from pyllama_paged.engine import EngineConfig, Model
    from pyllama_paged.engine.worker.model_runner import ModelRunner
    m = Model(model)
    runner = ModelRunner(m, EngineConfig(paged=True, n_ctx=16, block_size=16, num_blocks=1, n_threads=1, n_batch=16))
    try:
        return runner.kv_bytes_per_token
    finally:
        runner.close()
        m.close()


def launch_ours(flags: list[str], log: Path) -> tuple[subprocess.Popen, str, str]:
    """`pyllama-paged serve` on a free loopback port with `flags`, its output in `log`; (process,
    url, served model name) once healthy."""
    from pyllama_paged.testing.serving import free_port, stop_server, wait_healthy

    port = free_port()
    proc = subprocess.Popen([our_cli(), "serve", "--port", str(port), *flags],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, "/v1/models", log=log)
        import httpx
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    except BaseException:
        stop_server(proc)
        raise
    return proc, url, name


def start_ours(model: str | None, kv_tokens: int, args, seq_ctx: int, log: Path, extra=()):
    """Our server as the chat benchmarks run it (args: add_server_arguments'), a pool of
    kv_tokens; (process, url, model name)."""
    flags = ["--threads", str(args.threads), "--ctx", str(seq_ctx), "--kv-budget", str(kv_tokens),
             "--block-size", str(args.block_size), "--max-seqs", str(args.max_seqs), "--max-queue", "1024",
             "--itl-budget-ms", args.itl_budget_ms, "--gpu-layers", str(args.gpu_layers)]
    if model:
        flags += ["--model", model]
    return launch_ours([*flags, *extra], log)


# ---- the chat benchmarks' shared options -----------------------------------------------

def add_server_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the two servers and their sides (chat_trace, agent_trace, aiperf_bench)."""
    add_options(ap, threads=2, ctx=8192, block_size=16, max_seqs=64, model=None, gpu_layers=0, llama_server=None,
                sides="llama-server,ours",
                helps={"ctx": "llama-server total context (-c)"})
    ap.add_argument("--itl-budget-ms", default="auto", help="our server's inter-token budget (its default: auto)")
    ap.add_argument("--peers", default="np4,np16-kvu",
                    help="llama-server configurations, each npN (-np N) or npN-kvu (-np N -kvu)")


def llama_server_binary(args) -> str | None:
    """--llama-server, else the one bench/build_llama_cpp.sh builds; None when that side is not run."""
    if args.llama_server or "llama-server" not in args.sides:
        return args.llama_server
    return llama_cpp_tool("llama-server")


def stream_chat(client, model: str, messages: list[dict], max_tokens: int, record: dict, on_chunk=None):
    """One greedy streamed chat completion of max_tokens (past end-of-text) through an openai
    client: its tokens into record, on_chunk(chunk) for each chunk; returns (the stream, when the
    first text came, or None)."""
    stream = client.chat.completions.create(
        model=model, messages=messages, stream=True, max_tokens=max_tokens, temperature=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            record.update(tokens=chunk.usage.completion_tokens, prompt_tokens=chunk.usage.prompt_tokens)
        if on_chunk is not None:
            on_chunk(chunk)
    return stream, first
