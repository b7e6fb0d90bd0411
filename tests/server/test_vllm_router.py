"""vllm-router (the vLLM project's Rust router, from PyPI) in front of two plain
`pyllama-paged serve` processes on the default model: it finds them healthy through
/health, forwards OpenAI chats (streamed and not) that answer as the workers do directly,
and loses no request when a worker drains (SIGTERM with --drain-seconds: /health turns
503, the router stops sending it work, then it exits) or is killed outright.

On a hard kill, vllm-router's retries go back to the worker the policy picked until the
circuit breaker opens: with its default threshold (10 failures) the first request after
the kill fails with 500; with --cb-failure-threshold 1, as here, its retry goes to the
live worker. Slow: three processes and two loads of the model."""

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pyllama_paged.server.registry import DEFAULT_MODEL_NAME
from pyllama_paged.testing.serving import default_model_names, free_ports, stop_server, wait_healthy

openai = pytest.importorskip("openai")
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
if not Path(ROUTER).exists():
    pytest.skip("vllm-router is not installed (pip install vllm-router: a Rust wheel for x86_64 and "
                "aarch64 Linux)", allow_module_level=True)

pytestmark = pytest.mark.slow
QUESTIONS = ["Name a color.", "What is two plus two?", "Say hello in French."]


def start_worker(port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pyllama_paged.cli", "serve", "--port", str(port), "--threads", "1",
           "--drain-seconds", "3"]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd="/")


def chat(client, question: str, stream: bool) -> str:
    kwargs = dict(model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": question}], max_tokens=12,
                  temperature=0)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                   if c.choices)


@pytest.fixture
def cluster(tmp_path):
    """Two workers and vllm-router in front of them: (router URL, {port: worker}, tmp_path)."""
    # distinct, and from below the ephemeral range: bound only as each process comes up
    *ports, router_port, prometheus_port = free_ports(4, below_ephemeral=True)
    workers = {p: start_worker(p, tmp_path / f"worker-{p}.log") for p in ports}
    router = None
    try:
        for port, proc in workers.items():
            wait_healthy(f"http://127.0.0.1:{port}", proc, "/health", timeout=300, log=tmp_path / f"worker-{port}.log")
        cmd = [ROUTER, "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports], "--policy", "cache_aware",
               "--host", "127.0.0.1", "--port", str(router_port), "--prometheus-port", str(prometheus_port),
               "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
               "--health-failure-threshold", "1", "--health-success-threshold", "1",
               "--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "1", "--log-level", "warning"]
        router = subprocess.Popen(cmd, stdout=(tmp_path / "router.log").open("w"), stderr=subprocess.STDOUT,
                                  cwd="/")
        url = f"http://127.0.0.1:{router_port}"
        wait_healthy(url, router, "/v1/models", timeout=120, log=tmp_path / "router.log")
        yield url, workers, tmp_path
    finally:
        if router is not None:
            router.terminate()
            router.wait(20)
        for proc in workers.values():
            stop_server(proc)


def test_router_forwards_chats_and_loses_nothing_when_a_worker_goes(cluster):
    url, workers, tmp_path = cluster
    a, b = workers
    via_router = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=f"http://127.0.0.1:{a}/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in via_router.models.list().data] == default_model_names()
    assert httpx.get(url + "/health", timeout=10).status_code == 200   # the router's own, from the workers'
    for question in QUESTIONS:
        expected = chat(direct, question, stream=False)
        assert expected
        assert chat(via_router, question, stream=False) == expected
        assert chat(via_router, question, stream=True) == expected

    # a worker drains: /health says 503, the router stops sending it work, and it exits
    workers[a].send_signal(signal.SIGTERM)
    answers = []
    deadline = time.monotonic() + 60
    while workers[a].poll() is None:
        assert time.monotonic() < deadline, "the draining worker never exited"
        answers.append(chat(via_router, QUESTIONS[len(answers) % 3], stream=len(answers) % 2 == 1))
    assert workers[a].returncode == 0
    for _ in range(4):   # after it is gone
        answers.append(chat(via_router, QUESTIONS[len(answers) % 3], stream=len(answers) % 2 == 1))
    assert all(answers)

    # the worker comes back; once the router sees it healthy, the other one is killed outright
    workers[a] = start_worker(a, tmp_path / "worker-again.log")
    wait_healthy(f"http://127.0.0.1:{a}", workers[a], "/health", timeout=300, log=tmp_path / "worker-again.log")
    time.sleep(6)   # several of the router's health checks (one a second) to mark it healthy again
    workers[b].kill()
    workers[b].wait()
    for i in range(6):
        question = QUESTIONS[i % 3]
        assert chat(via_router, question, stream=i % 2 == 1) == chat(direct, question, stream=False)

