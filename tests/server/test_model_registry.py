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

    # one slot beside the --model file (at least one, whatever the cap says)
    registry = _registry(three_models, max_loaded_models=1)
    registry.LOAD_WAIT_S = 0.5
    server = Running(create_app(registry))

    def generate(model):
        return httpx.post(f"{server.url}/api/generate", timeout=60,
                          json={"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 1}})
    try:
        assert generate("a").status_code == 200
        a = registry.served("a")
        a.active += 1   # a request in flight holds it: it may not be unloaded
        try:
            r = generate("b")
            assert r.status_code == 503, r.text
            assert "every one is in use" in r.json()["error"]
            assert generate("base").status_code == 200   # the operator's model is not in that queue
        finally:
            a.active -= 1
        r = generate("b")
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


# ---- the operator's models against a client of pulled ones (issue 54) ------------------------
def test_streams_on_pulled_models_never_unload_or_lock_out_the_operators_model(three_models):
    """Three pulled models held busy used to take every slot: the operator's --model was
    unloaded to make room, and then could not load again while they ran."""
    from pyllama_paged.server.app import create_app
    from pyllama_paged.testing.serving import Running

    registry = _registry(three_models)   # --max-loaded-models 3: two slots beside the --model file
    registry.LOAD_WAIT_S = 0.5
    server = Running(create_app(registry))
    base = registry.served("base")

    def generate(model, **extra):
        return httpx.post(f"{server.url}/api/generate", timeout=60, json={
            "model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 1}, **extra})
    try:
        held = []
        for name in ("a", "b"):
            assert generate(name).status_code == 200
            held.append(registry.served(name))
            held[-1].active += 1   # the client's stream on it, still running
        base.last_used = 0.0       # idle longest of all: the first victim before
        r = generate("c")
        assert r.status_code == 503 and "beside its --model files" in r.json()["error"], r.text
        assert base.is_loaded and generate("base").status_code == 200
        # unloaded by a client's keep_alive 0, it loads again at once: it waits for no room
        assert generate("base", keep_alive=0).status_code == 200 and not base.is_loaded
        assert generate("base").status_code == 200 and base.is_loaded
        for served in held:
            served.active -= 1
        assert generate("c").status_code == 200   # pulled models make room among themselves
        loaded = {name for name, m in registry.models.items() if m.is_loaded}
        assert "base" in loaded and len(loaded - {"base"}) == 2
    finally:
        server.close()
        registry.close()


def test_a_name_pulled_again_serves_the_new_file(model_sources, tmp_path):
    """A stored name pulled again (a new version of the tag) kept serving the file that was
    loaded first; the old engine now finishes its requests and goes."""
    from pyllama_paged.server.app import create_app
    from pyllama_paged.testing.serving import Running, wait_until

    first = Path(write_tiny_model(tmp_path / "first.gguf", "gemma3", seed=1)).read_bytes()
    model_sources.add_registry_model("m", "latest", first)
    old_path = pull("m").path
    registry = _registry(tmp_path)
    server = Running(create_app(registry))

    def show():
        return httpx.post(f"{server.url}/api/show", json={"model": "m"}, timeout=60).json()["modelfile"]
    try:
        assert show() == f"FROM {old_path}\n"
        old = registry.served("m")
        old.active += 1   # a request still running on the old file

        def with_template(writer, rng):
            writer.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}")
        second = Path(write_tiny_model(tmp_path / "second.gguf", "gemma3", seed=2, extend=with_template)).read_bytes()
        model_sources.add_registry_model("m", "latest", second)
        new_path = pull("m").path
        assert new_path != old_path
        assert show() == f"FROM {new_path}\n"
        r = httpx.post(f"{server.url}/api/generate", timeout=60,
                       json={"model": "m", "prompt": "hi", "stream": False, "options": {"num_predict": 1}})
        assert r.status_code == 200 and registry.served("m") is not old
        assert old.is_loaded   # its request is not cut off
        old.active -= 1
        wait_until(lambda: not old.is_loaded, what="the old engine's unload")
    finally:
        server.close()
        registry.close()


def test_the_404_of_an_unknown_name_lists_a_few_names_of_a_big_store(model_sources, tmp_path):
    """A store of thousands of names made every 404 tens of KiB (and read every manifest)."""
    from pyllama_paged.models.store import ModelStore
    from pyllama_paged.server.app import create_app
    from pyllama_paged.testing.serving import Running

    model_sources.add_registry_model("m0000", "latest", Path(write_tiny_model(tmp_path / "m.gguf", "gemma3")).read_bytes())
    stored = pull("m0000")
    record = stored.manifest.read_text()
    for i in range(1, 3000):   # the same file under 2,999 more names, as 3,000 pulls would leave them
        folder = stored.manifest.parent.parent / f"m{i:04d}"
        folder.mkdir(mode=0o700)
        (folder / "latest.json").write_text(record.replace('"m0000:latest"', f'"m{i:04d}:latest"'))
    (ModelStore().root / "manifests" / "index.json").unlink()
    registry = _registry(tmp_path)
    server = Running(create_app(registry))
    try:
        r = httpx.post(f"{server.url}/api/generate", json={"model": "nope", "prompt": "hi"}, timeout=60)
        assert r.status_code == 404
        message = r.json()["error"]
        assert len(r.content) < 1024, len(r.content)
        assert message.endswith("available: base, m0000:latest, m0001:latest, m0002:latest, m0003:latest, "
                                "m0004:latest, m0005:latest, m0006:latest, m0007:latest, m0008:latest and 2991 more "
                                "(GET /api/tags or /v1/models lists them)"), message
        assert httpx.post(f"{server.url}/api/show", json={"model": "m2999"}, timeout=60).status_code == 200
    finally:
        server.close()
        registry.close()
