"""Speculative decoding through the HTTP server: the serve flags, the per-request
opt-out in Ollama's options and OpenAI's body, and the counters in /api/pool and
/metrics."""

import httpx
import pytest

from pyllama_paged.cli import build_parser, serve_config
from pyllama_paged.engine import SpeculativeConfig, default_model_path
from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME, ModelRegistry
from pyllama_paged.server.config import ServeConfig
from pyllama_paged.testing.serving import Running

PROMPT = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog while the "
          "cat sleeps on the warm windowsill in the afternoon sun.")


@pytest.fixture(scope="module")
def server():
    registry = ModelRegistry(None, ServeConfig.flat(n_ctx=512, n_threads=2, n_batch=256, kv_budget_tokens=4096,
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


def _speculative(args):
    return serve_config(args).engine.speculative


def test_serve_flags_make_a_config():
    args = build_parser().parse_args(["serve", "--speculative", "prompt_lookup", "--num-draft-tokens", "6"])
    assert _speculative(args) == SpeculativeConfig(num_draft_tokens=6)
    assert _speculative(build_parser().parse_args(["serve"])) is None
    with pytest.raises(SystemExit):
        _speculative(build_parser().parse_args(["serve", "--speculative", "prompt_lookup",
                                                "--num-draft-tokens", "0"]))


def test_serve_flags_for_a_draft_model():
    args = build_parser().parse_args(["serve", "--speculative", "draft_model", "--draft-model", "/m/d.gguf",
                                      "--num-draft-tokens", "3"])
    assert _speculative(args) == SpeculativeConfig(method="draft_model", draft_model="/m/d.gguf",
                                                   num_draft_tokens=3)
    # --draft-model alone says the method; with prompt lookup, or missing, it is refused
    assert _speculative(build_parser().parse_args(["serve", "--draft-model", "/m/d.gguf"])).method == "draft_model"
    for bad in (["--speculative", "draft_model"], ["--speculative", "prompt_lookup", "--draft-model", "/m/d.gguf"]):
        with pytest.raises(SystemExit):
            _speculative(build_parser().parse_args(["serve", *bad]))


def test_a_served_model_drafts_with_a_draft_model():
    """The default model drafting for itself behind the server: every draft of a greedy
    answer is accepted, up to near-ties."""
    spec = SpeculativeConfig(method="draft_model", draft_model=default_model_path(), num_draft_tokens=4)
    registry = ModelRegistry(None, ServeConfig.flat(n_ctx=512, n_threads=2, n_batch=256, kv_budget_tokens=2048,
                                                    speculative=spec))
    running = Running(create_app(registry, Limits()))
    try:
        assert _ollama(running.url)
        drafted, accepted = _counts(running.url)
        assert 0 < accepted <= drafted and accepted >= 0.9 * drafted
        stats = httpx.get(f"{running.url}/api/pool").json()["stats"]
        assert stats["spec_draft_blocks_used"] == 0 and stats["spec_draft_forward_seconds"] > 0
        assert "pyllama_spec_draft_forward_seconds_total" in httpx.get(f"{running.url}/metrics").text
    finally:
        running.close()
        registry.close()


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
