"""The loaded-model registry (issue 39): a cap on loaded engines with the least recently used
idle one dropped first, pulled models that go after Ollama's 5 idle minutes by default, one
engine per GGUF file whatever its names; and `serve --kv-budget` in each documented form. The
models are tiny random-weight GGUFs pulled from the local registry stand-in."""

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pyllama_paged.models.pull import pull
from pyllama_paged.server.registry import ModelRegistry
from pyllama_paged.server.config import ServeConfig
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.serving import free_port, stop_server, wait_healthy

SETTINGS = dict(n_ctx=256, n_threads=2, n_batch=64, kv_budget_tokens=1024, max_num_seqs=4)


@pytest.fixture
def three_models(model_sources, tmp_path):
    """Three pulled models with different GGUFs (a, b, c) and a second tag of a (a:v2)."""
    for i, name in enumerate("abc"):
        data = Path(write_tiny_model(tmp_path / f"{name}.gguf", "gemma3", seed=i + 1)).read_bytes()
        model_sources.add_registry_model(name, "latest", data)
        if name == "a":
            model_sources.add_registry_model("a", "v2", data)
    for name in ("a", "b", "c", "a:v2"):
        pull(name)
    return tmp_path


def _registry(tmp_path, **options) -> ModelRegistry:
    base = write_tiny_model(tmp_path / "base.gguf", "gemma3", seed=9)
    return ModelRegistry([base], ServeConfig.flat(**{**SETTINGS, **options}))


def test_loading_past_the_cap_drops_the_least_recently_used_idle_engine(three_models):
    registry = _registry(three_models, max_loaded_models=2)

    async def scenario():
        base = registry.served("base")
        a = await registry.resolve("a")
        assert base.is_loaded and a.is_loaded
        base.last_used, a.last_used = time.time(), time.time() - 60   # a idle longest
        b = await registry.resolve("b")
        assert b.is_loaded and not a.is_loaded and base.is_loaded
        # a busy engine is never dropped: the idle one goes instead
        await base.acquire()
        try:
            base.last_used = time.time() - 600
            c = await registry.resolve("c")
            assert c.is_loaded and not b.is_loaded and base.is_loaded
        finally:
            base.release()
        assert sum(m.is_loaded for m in registry.models.values()) == 2
        # the dropped one comes back on its next use, under the same cap
        await a.acquire()
        a.release()
        assert a.is_loaded and sum(m.is_loaded for m in registry.models.values()) == 2

    try:
        asyncio.run(scenario())
    finally:
        registry.close()


def test_no_room_while_every_engine_is_busy_is_a_503(three_models):
    from pyllama_paged.server.app import create_app
    from pyllama_paged.testing.serving import Running

    registry = _registry(three_models, max_loaded_models=1)
    registry.LOAD_WAIT_S = 0.5
    server = Running(create_app(registry))
    try:
        base = registry.served("base")
        assert base.is_loaded
        base.active += 1   # a request in flight holds it: it may not be unloaded
        try:
            r = httpx.post(f"{server.url}/api/generate", json={"model": "a", "prompt": "hi", "stream": False},
                           timeout=60)
            assert r.status_code == 503, r.text
            assert "every one is in use" in r.json()["error"]
        finally:
            base.active -= 1
        r = httpx.post(f"{server.url}/api/generate", timeout=60,
                       json={"model": "a", "prompt": "hi", "stream": False, "options": {"num_predict": 1}})
        assert r.status_code == 200, r.text   # once it is idle, it makes room
    finally:
        server.close()
        registry.close()


def test_a_pulled_model_gets_ollamas_default_keep_alive(three_models):
    registry = _registry(three_models)

    async def scenario():
        a = await registry.resolve("a")
        assert a.keep_alive == 300.0 and registry.served("base").keep_alive is None   # a --model file: forever
        a.keep_alive = None   # a request that says nothing
        assert a.keep_alive == 300.0
        a.keep_alive = -1
        assert a.keep_alive == -1
        a.keep_alive = None
        now = time.time()
        assert not a.expired(now) and a.expired(now + 301)

    try:
        asyncio.run(scenario())
    finally:
        registry.close()


def test_names_of_one_file_share_one_engine(three_models):
    registry = _registry(three_models)

    async def scenario():
        a = await registry.resolve("a")
        again = await registry.resolve("a:v2")
        assert again is a and a.loads == 1
        assert len([m for m in registry.models.values() if m.is_loaded]) == 2   # base and a
        # the --model file asked for by a stored name of the same file: the same engine
        return a

    try:
        asyncio.run(scenario())
        # deleting one name keeps the file the other names
        v2 = registry.store.find_name("a:v2")
        asyncio.run(registry.delete_stored(v2))
        assert registry.served("a:v2") is None and Path(v2.path).exists()
    finally:
        registry.close()


def test_serve_starts_with_each_documented_kv_budget_form(tmp_path):
    base = write_tiny_model(tmp_path / "base.gguf", "gemma3")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for budget in ("1024", "84MiB", "1.5MiB", "2MB"):
        port = free_port()
        log = tmp_path / f"serve-{budget}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "pyllama_paged.cli", "serve", "--model", base, "--port",
                                     str(port), "--threads", "2", "--ctx", "256", "--kv-budget", budget],
                                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd="/")
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, "/api/tags", timeout=120, log=log)
            stats = httpx.get(f"http://127.0.0.1:{port}/api/pool", timeout=30).json()["stats"]
            assert stats["blocks_total"] > 0, (budget, stats)
        finally:
            stop_server(proc)
