"""Speculative decoding through the HTTP server: the serve flags, the per-request
opt-out in Ollama's options and OpenAI's body, and the counters in /api/pool and
/metrics."""

import httpx
import pytest

from pyllama_paged.cli import _speculative, build_parser
from pyllama_paged.engine.spec_draft import SpeculativeConfig
from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME, EngineOptions, ModelRegistry
from pyllama_paged.testing.serving import Running

PROMPT = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog while the "
          "cat sleeps on the warm windowsill in the afternoon sun.")


@pytest.fixture(scope="module")
def server():
    registry = ModelRegistry(None, EngineOptions(n_ctx=512, n_threads=2, n_batch=256, kv_budget_tokens=4096,
                                                 speculative=SpeculativeConfig(num_draft_tokens=4)))
    running = Running(create_app(registry, Limits()))
    yield running
    running.close()
    registry.close()


def _counts(url):
    stats = httpx.get(f"{url}/api/pool").json()["stats"]
    return stats["spec_draft_tokens"], stats["spec_accepted_tokens"]


def _ollama(url, speculative=None):
    options = {"num_predict": 40, "temperature": 0}
    if speculative is not None:
        options["speculative"] = speculative
    r = httpx.post(f"{url}/api/generate", json={"model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "stream": False,
                                                "options": options}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["response"]


def test_serve_flags_make_a_config():
    args = build_parser().parse_args(["serve", "--speculative", "prompt_lookup", "--num-draft-tokens", "6"])
    assert _speculative(args) == SpeculativeConfig(num_draft_tokens=6)
    assert _speculative(build_parser().parse_args(["serve"])) is None
    with pytest.raises(SystemExit):
        _speculative(build_parser().parse_args(["serve", "--speculative", "prompt_lookup",
                                                "--num-draft-tokens", "0"]))


def test_requests_speculate_unless_they_opt_out(server):
    before = _counts(server.url)
    plain = _ollama(server.url, speculative=False)
    assert _counts(server.url) == before
    fast = _ollama(server.url)
    drafted, accepted = (a - b for a, b in zip(_counts(server.url), before))
    assert 0 < accepted <= drafted
    assert fast == plain   # a copying prompt: the greedy answer is far from any near-tie
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "pyllama_spec_accepted_tokens_total" in metrics


def test_openai_field_opts_out(server):
    before = _counts(server.url)
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                         "speculative": False}, timeout=120)
    assert r.status_code == 200, r.text
    assert _counts(server.url) == before
    bad = httpx.post(f"{server.url}/v1/completions",
                     json={"model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "speculative": "no"}, timeout=120)
    assert bad.status_code == 400
