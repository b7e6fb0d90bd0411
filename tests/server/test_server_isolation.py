"""No request hurts another user: a reload shared by every waiter, figures that never
wait on a busy engine, prompt work off the event loop in a pool of its own, the queue
limit on every route, a keep_alive watcher that outlives a failure. On a tiny model."""

import concurrent.futures
import gc
import threading

import httpx
import pytest

from pyllama_paged.testing.loop_control import paused
from pyllama_paged.testing.serving import Running, tiny_registry, wait_until
from pyllama_paged.engine.kv.block_pool import BlockPool
from pyllama_paged.engine import EngineLoop
from pyllama_paged.calls import chat_call
from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits

M = "tiny"
GENERATE = {"model": M, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}


@pytest.fixture
def registry(tmp_path):
    reg = tiny_registry(tmp_path)
    yield reg
    reg.close()


def _live_engines(path: str) -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, EngineLoop) and o._thread.is_alive()
               and getattr(getattr(o.llm.runner, "model", None), "path", None) == path)


def test_hanging_up_during_a_reload_loads_the_model_once(registry):
    # The waiter that hung up used to release the lock while its load went on: the next
    # request loaded a second copy, and the first was never freed.
    served = registry.get(M)
    s = Running(create_app(registry, Limits()))
    gate, calls = threading.Event(), []
    real_load = served._load

    def gated_load():
        calls.append(1)
        gate.wait(60)
        real_load()

    try:
        r = httpx.post(s.url + "/api/generate", json={"model": M, "keep_alive": 0})   # Ollama's unload
        assert r.json()["done_reason"] == "unload" and not served.is_loaded
        loads = served.loads
        served._load = gated_load
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/api/generate", json=GENERATE, timeout=httpx.Timeout(30, read=0.5))
        counts = s.app.state.pp.metrics.requests
        wait_until(lambda: counts[("/api/generate", 499)] == 1, what="the hang-up")
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            second = ex.submit(httpx.post, s.url + "/api/generate", json=GENERATE, timeout=60)
            # the second request waits for the engine (on the shared load, or on a load of its own)
            wait_until(lambda: served.active >= 1 or len(calls) >= 2, what="the second request waiting")
            gate.set()
            assert second.result().status_code == 200
        assert served.loads - loads == 1 and len(calls) == 1
        gc.collect()
        assert _live_engines(served.path) == 1
    finally:
        gate.set()
        served.__dict__.pop("_load", None)
        s.close()


def test_figures_are_counts_and_never_wait_on_a_held_engine(registry, monkeypatch):
    # /api/pool walked every block on the engine thread, and /metrics, /api/ps and
    # /api/pool waited for that thread with no limit: a long step hung them all.
    walked = []
    real_info = BlockPool.block_info
    monkeypatch.setattr(BlockPool, "block_info", lambda self, b: walked.append(b) or real_info(self, b))
    s = Running(create_app(registry, Limits(stats_timeout=0.2)))
    try:
        pool = httpx.get(s.url + "/api/pool").json()
        assert walked == [] and pool["current"] is True
        assert len(pool["blocks"]) == pool["stats"]["blocks_total"] == sum(pool["counts"].values())
        with paused(registry.get(M).loop):
            for path in ("/metrics", "/api/ps", "/api/pool"):
                r = httpx.get(s.url + path, timeout=20)   # a deadline for a hang only
                assert r.status_code == 200, path
            assert 'pyllama_kv_blocks_free{model="tiny"}' in httpx.get(s.url + "/metrics", timeout=20).text
            held = httpx.get(s.url + "/api/pool", timeout=20).json()
            assert held["current"] is False and held["stats"]["blocks_total"] == pool["stats"]["blocks_total"]
            assert httpx.get(s.url + "/api/ps", timeout=20).json()["models"][0]["kv_cache"]["current"] is False
        wait_until(lambda: httpx.get(s.url + "/api/pool").json()["current"], what="fresh figures")
    finally:
        s.close()


def test_slow_prompt_work_leaves_other_routes_answering(registry, monkeypatch):
    # Templates and tokenizing ran on the event loop (/api/generate) or on the loop's
    # default pool (/api/chat), which every route shares: a few big requests stalled all.
    served = registry.get(M)
    gate, entered = threading.Event(), []

    def slowed(render):
        def slow_render(*args, **kwargs):
            if "SLOW" in repr(args):   # the request's messages
                entered.append(1)
                gate.wait(60)
            return render(*args, **kwargs)
        return slow_render

    # where the routes render: /api/generate through the template, /api/chat through render_chat
    monkeypatch.setattr(served.template, "render", slowed(served.template.render))
    monkeypatch.setattr(chat_call, "render_chat", slowed(chat_call.render_chat))
    s = Running(create_app(registry, Limits(prep_threads=2)))
    chat = {"model": M, "stream": False, "messages": [{"role": "user", "content": "SLOW"}],
            "options": {"num_predict": 1}}
    ex = concurrent.futures.ThreadPoolExecutor(10)
    try:
        slow = [ex.submit(httpx.post, s.url + "/api/chat", json=chat, timeout=120) for _ in range(8)]
        slow.append(ex.submit(httpx.post, s.url + "/api/generate", timeout=120,
                              json={**GENERATE, "prompt": "SLOW"}))
        wait_until(lambda: len(entered) >= 2, what="prompt work under way")
        for path in ("/api/tags", "/metrics", "/api/ps", "/v1/models", "/api/pool", "/api/version"):
            assert httpx.get(s.url + path, timeout=20).status_code == 200, path   # a deadline for a hang only
    finally:
        gate.set()
        statuses = [f.result().status_code for f in slow]
        ex.shutdown()
        s.close()
    assert statuses == [200] * 9


def test_keep_alive_watcher_survives_a_failure(registry, caplog):
    # The watcher's first exception ended it: no model was ever unloaded again.
    served = registry.get(M)
    failures = []
    real_unload = served.unload_if_idle

    async def flaky_unload():
        if not failures:
            failures.append(1)
            raise RuntimeError("injected unload failure")
        return await real_unload()

    served.unload_if_idle = flaky_unload
    s = Running(create_app(registry, Limits()))
    try:
        r = httpx.post(s.url + "/api/generate", json={**GENERATE, "keep_alive": "100ms"}, timeout=60)
        assert r.status_code == 200
        wait_until(lambda: not served.is_loaded, what="the unload after the failure")
        assert failures and "injected unload failure" in caplog.text
    finally:
        served.__dict__.pop("unload_if_idle", None)
        s.close()
