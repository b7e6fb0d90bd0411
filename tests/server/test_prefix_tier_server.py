"""The prefix cache's disk tier through the HTTP server: a server restarted on the
same directory restores a long system prompt instead of recomputing it, a server
whose block files were damaged answers the same, and the tier's counters show in
/api/pool and /metrics. Plus the serve flags."""

import logging
import os

import httpx
import pytest

from pyllama_paged.cli import build_parser, serve_config
from pyllama_paged.engine import PrefixTierConfig
from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME, ModelRegistry
from pyllama_paged.server.config import ServeConfig
from pyllama_paged.testing.serving import Running

SYSTEM = ("You are the assistant of a bicycle repair shop. Opening hours are 9 to 18 on weekdays. "
          "Repairs take two days; a tune-up costs 40 euros; tyres are replaced while you wait. ") * 24


def _serve(directory: str):
    tiers = PrefixTierConfig(ram_bytes=0, disk_dir=directory)
    registry = ModelRegistry(None, ServeConfig.flat(n_ctx=2048, n_threads=2, n_batch=256, kv_budget_tokens=8192,
                                                    prefix_tiers=tiers))
    return registry, Running(create_app(registry, Limits()))


def _ask(url: str) -> tuple[str, dict]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": DEFAULT_MODEL_NAME, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When can I come by?"}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], httpx.get(f"{url}/api/pool").json()["stats"]


def _restart(directory: str) -> tuple[str, dict, str]:
    """One server's life: one question, its answer, stats and /metrics, then shut down."""
    registry, running = _serve(directory)
    try:
        answer, stats = _ask(running.url)
        metrics = httpx.get(f"{running.url}/metrics").text
    finally:
        running.close()
        registry.close()   # closing the engine finishes its queued disk writes
    return answer, stats, metrics


def test_a_restarted_server_restores_the_prompt_from_disk(tmp_path):
    directory = str(tmp_path / "blocks")
    cold, stats, _ = _restart(directory)
    assert stats["tier_disk_hit_blocks"] == 0 and stats["tier_saved_blocks"] > 20
    computed_cold = stats["computed_tokens"]
    assert len(os.listdir(directory)) >= stats["tier_saved_blocks"]
    warm, stats, metrics = _restart(directory)
    assert warm == cold
    assert stats["tier_disk_hit_blocks"] > 20 and stats["computed_tokens"] < computed_cold / 4
    assert "pyllama_prefix_tier_disk_hit_blocks_total" in metrics and "prefix_tier_hit_tokens_total" in metrics
    # every block file damaged: a flipped byte in each payload (the directory's secret and
    # lock file are not blocks)
    for name in [n for n in os.listdir(directory) if n.endswith(".kvb")]:
        path = os.path.join(directory, name)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xA5]))
    damaged, stats, _ = _restart(directory)
    assert damaged == cold
    assert stats["tier_disk_corrupt_files"] >= 1 and stats["tier_disk_hit_blocks"] == 0
    assert stats["computed_tokens"] == computed_cold


def _serve_flags(*argv):
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_kv_events_flags_default_to_loopback_and_hashes_only():
    config = _serve_flags("--kv-events").kv_events
    assert config.endpoint == "tcp://127.0.0.1:5557" and config.token_ids is False and config.bind is None
    config = _serve_flags("--kv-events", "tcp://10.0.0.5:5557", "--kv-events-token-ids", "--kv-events-bind").kv_events
    assert (config.endpoint, config.token_ids, config.bind) == ("tcp://10.0.0.5:5557", True, True)
    assert _serve_flags().kv_events is None
    assert _serve_flags("--prefix-cache-group").engine.prefix_tiers.disk_group


def test_serve_flags_make_a_tier_config(tmp_path, capsys):
    assert _serve_flags().engine.prefix_tiers == PrefixTierConfig(ram_bytes=2048 << 20)
    tiers = _serve_flags("--cache-ram", "0", "--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk", "1GiB")
    assert tiers.engine.prefix_tiers == PrefixTierConfig(ram_bytes=0, disk_dir=str(tmp_path), disk_bytes=1 << 30)
    assert _serve_flags("--cache-ram", "0").engine.prefix_tiers is None
    for bad, says in ((["--cache-ram", "-1"], "--cache-ram: must be >= 0 MiB"),
                      (["--prefix-cache-disk", "lots"], "--prefix-cache-disk: 'lots' is not a size such as 16GiB")):
        with pytest.raises(SystemExit):   # refused by the parser, which says why on stderr
            _serve_flags(*bad)
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit, match="cannot be used"):
        _serve_flags("--prefix-cache-dir", "/proc/no-such-place")


def test_reset_prefix_cache_empties_the_ram_tier_and_says_what_disk_keeps(tmp_path, caplog):
    """POST /reset_prefix_cache (a router's, or an operator's after a sensitive session):
    the RAM tier's blocks go with the pool's; the disk tier, shared with other servers, is
    kept, and the log says so."""
    from pyllama_paged.testing.serving import tiny_registry

    directory = tmp_path / "blocks"
    registry = tiny_registry(tmp_path, block_size=16, n_ctx=256,
                             prefix_tiers=PrefixTierConfig(ram_bytes=64 << 20, disk_dir=str(directory)))
    running = Running(create_app(registry, Limits()))
    caplog.set_level(logging.INFO, logger="pyllama_paged.server")
    try:
        r = httpx.post(f"{running.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "a private question about my account " * 3, "max_tokens": 2})
        assert r.status_code == 200, r.text
        before = httpx.get(f"{running.url}/api/pool").json()["stats"]
        assert before["tier_ram_blocks"] > 0
        registry.get("tiny").loop.call(lambda llm: llm.tiers.flush())
        files = sorted(os.listdir(directory))
        r = httpx.post(f"{running.url}/reset_prefix_cache")
        assert r.status_code == 200 and r.content == b""   # vLLM's answer
        after = httpx.get(f"{running.url}/api/pool").json()["stats"]
        assert after["tier_ram_blocks"] == 0 and after["tier_ram_bytes"] == 0
        assert sorted(os.listdir(directory)) == files
        said = [r.getMessage() for r in caplog.records if "reset" in r.getMessage()]
        assert said and f"{before['tier_ram_blocks']} blocks dropped from the RAM tier" in said[-1]
        assert f"the disk tier {directory} is kept" in said[-1]
    finally:
        running.close()
        registry.close()
