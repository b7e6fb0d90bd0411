"""Cost-based fuzzing: schemathesis requests to every POST route, their list and
text fields inflated up to the server's documented default limits (stop strings,
messages, tools, logit_bias, grammar, embedding inputs, the body itself). Every
request must end (an answer or a 4xx) and none may stall the server for its other
users: a probe that lists the models the whole time must keep being answered.

Marked slow (CI runs it): each case costs what the limits allow, on purpose."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.testing.serving import Running, tiny_registry

pytestmark = pytest.mark.slow

M = "tiny"
LIMITS = Limits()                # the documented defaults, not test-sized ones
MAX_EXAMPLES = 12                # per operation
# Generous: a request that was bounded takes seconds; one that was not took minutes.
REQUEST_BOUND_S = 60.0
PROBE_BOUND_S = 10.0


def _words(n_chars: int, rng: random.Random) -> str:
    return " ".join(rng.choice(["lorem", "ipsum", "dolor", "sit", "amet", "```", "{", "}"])
                    for _ in range(n_chars // 6))


def at_the_limits(body: dict, rng: random.Random) -> dict:
    """The body with each list or text field it has grown to the documented limit, as
    long as the whole stays under the body limit."""
    L = LIMITS
    grown = dict(body)
    if "stop" in grown:
        grown["stop"] = ["".join(rng.choice("ab ") for _ in range(L.max_stop_chars)) for _ in range(L.max_stop)]
    if "messages" in grown:
        grown["messages"] = [{"role": "user" if i % 2 == 0 else "assistant", "content": _words(12, rng)}
                             for i in range(L.max_messages - 1)] + [{"role": "user", "content": "hi"}]
    if "tools" in grown:
        tool = {"type": "function", "function": {"name": "f", "description": _words(60, rng),
                                                 "parameters": {"type": "object", "properties": {
                                                     "x": {"type": "string"}}}}}
        grown["tools"] = [{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(L.max_tools)]
    if "logit_bias" in grown:
        grown["logit_bias"] = {str(i): -1.0 for i in range(L.max_logit_bias)}
    if "grammar" in grown:
        grown["grammar"] = "root ::= " + " | ".join(f'"{i}"' for i in range(L.max_grammar_bytes // 8))
    if "input" in grown:
        grown["input"] = [_words(rng.randint(1, 200), rng) for _ in range(L.max_embedding_inputs)]
    for key in ("prompt", "system", "suffix"):
        if isinstance(grown.get(key), str):
            grown[key] = _words(L.max_body_bytes // 2, rng)
    while len(json.dumps(grown).encode()) > L.max_body_bytes:   # the body limit is a limit too
        biggest = max((k for k in grown if isinstance(grown[k], (list, str))),
                      key=lambda k: len(json.dumps(grown[k])))
        grown[biggest] = grown[biggest][:len(grown[biggest]) * 3 // 4]
    return grown


class Probe:
    """Another user: lists the models every 50 ms; the slowest answer is kept."""

    def __init__(self, url: str):
        self.url, self.slowest, self.errors = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    client.get(self.url + "/api/tags").raise_for_status()
                except httpx.HTTPError:
                    self.errors += 1
                self.slowest = max(self.slowest, time.monotonic() - started)
                self._stop.wait(0.05)

    def stop(self):
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    registry = tiny_registry(tmp_path_factory.mktemp("cost"))
    s = Running(create_app(registry, LIMITS))
    yield s
    s.close()
    registry.close()


def test_requests_at_the_limits_end_and_never_stall_others(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    stats: Counter = Counter()
    slow: list[str] = []
    probe = Probe(server.url)
    try:
        for result in schema.get_all_operations():
            op = result.ok()
            if op.method.upper() != "POST":
                continue

            @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE), seed=st.integers(0, 2**16))
            @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            def check(case, seed):
                if isinstance(case.body, dict):
                    case.body = at_the_limits({**case.body, "model": M}, random.Random(seed))
                started = time.monotonic()
                response = case.call(timeout=REQUEST_BOUND_S + 30)
                took = time.monotonic() - started
                stats["cases"] += 1
                stats[f"{response.status_code // 100}xx"] += 1
                assert response.status_code < 500, f"{op.label}: {response.status_code} {response.text[:300]}"
                if took > REQUEST_BOUND_S:
                    slow.append(f"{op.label}: {took:.1f} s")

            check()
    finally:
        probe.stop()
    print(f"\ncost fuzzing: {dict(stats)}; slowest probe answer {probe.slowest:.2f} s")
    assert stats["cases"] > 50 and stats["2xx"] > 5
    assert not slow, slow
    assert probe.errors == 0 and probe.slowest < PROBE_BOUND_S
