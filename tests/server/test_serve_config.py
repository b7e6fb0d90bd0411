"""One configuration corridor (issue 50): `serve` builds each model's engine from its
ServeConfig, and every EngineConfig field reaches the model and its engine. Before, the
server loaded the weights with two of the model's four settings and silently dropped
pack_panels and repack_weights."""

import dataclasses

import pytest

from pyllama_paged.cli import build_parser, serve_config
from pyllama_paged.engine import EngineConfig, PrefixTierConfig, SchedulerConfig, SpeculativeConfig
from pyllama_paged.server.config import ServeConfig, served_engine
from pyllama_paged.server.registry import ModelRegistry
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model

# a value other than the served default for every EngineConfig field, each one the served
# model's engine can show; None: why the field is not set here
CHANGED = {
    "model_path": None,      # the server sets each model's own (ServeConfig.engine_for)
    "mmproj": None,          # a projector file: tests/server/test_vision_api.py serves one
    "n_ctx": 192,
    "n_batch": 48,
    "n_threads": 1,
    "adapt_threads": True,
    "paged": True,           # the default; paged=False is the slab baseline, checked in test_engine_reference
    "block_size": 64,        # whole Q8_0 groups
    "kv_cache_type": "q8_0",
    "num_blocks": 40,
    "kv_bytes": 1 << 20,     # num_blocks wins over it (EngineConfig's first match)
    "kv_tokens": 1024,
    "n_seq_max": 3,
    "state_slots": 4,        # hybrids' (this tiny gemma3 file has no recurrent state: the setting still arrives)
    "state_checkpoints": 1,
    "state_checkpoint_every": 2,
    "free_window_blocks": False,
    "attention": "gather",
    "repack_weights": False,
    "pack_panels": False,
    "n_gpu_layers": None,    # a GPU is not there to take layers: test_device_engine covers them
    "main_gpu": None,
    "scheduler": SchedulerConfig(max_num_seqs=5, preemption_mode="swap", itl_budget=0.5),
    "speculative": SpeculativeConfig(num_draft_tokens=2),
    "prefix_tiers": PrefixTierConfig(ram_bytes=8 << 20),
}


def test_the_table_names_every_engine_field():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(EngineConfig)}, "a new EngineConfig field: add it"


def test_every_engine_setting_reaches_the_served_model(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", "gemma3", weight_type="q8_0")
    defaults = ModelRegistry([path], ServeConfig.flat(n_ctx=192, n_threads=1))
    try:   # the settings this test turns off are on by default: the check below can fail
        model = defaults.get("tiny").model
        assert model.n_panel_packed > 0 or model.n_repacked > 0
    finally:
        defaults.close()
    settings = {name: value for name, value in CHANGED.items() if value is not None}
    config = ServeConfig(engine=served_engine(**settings))
    registry = ModelRegistry([path], config)
    try:
        served = registry.get("tiny")
        given = served.engine_config()
        for name in settings:
            want = getattr(config.engine, name)
            if name == "scheduler":   # the server's one token budget per step
                want = dataclasses.replace(want, max_num_batched_tokens=config.engine.n_batch)
            assert getattr(given, name) == want, name
        assert given.model_path == str(path)
        model, engine = served.model, served.engine
        runner = engine.runner
        assert (model.n_repacked, model.n_panel_packed) == (0, 0)   # repack_weights, pack_panels
        assert (runner.n_ctx, runner.n_batch, runner.n_threads, runner.kv_cache_type, runner.attention) == \
               (192, 48, 1, "q8_0", "gather")
        assert runner.thread_policy is not None   # adapt_threads
        assert (runner.kv.paged, runner.kv.block_size, runner.kv.num_blocks, runner.kv_groups.n_groups) == \
               (True, 64, 40, 1)   # free_window_blocks off: one group for the sliding-window layers too
        assert engine.scheduler.config == given.scheduler
        assert engine.speculator.config == settings["speculative"]
        assert engine.tiers is not None and engine.tiers.ram is not None
    finally:
        registry.close()


def test_serve_options_make_one_serve_config():
    config = serve_config(build_parser().parse_args(
        ["serve", "--model", "a.gguf", "--model", "b.gguf", "--port", "9000", "--ctx", "512", "--max-seqs", "7",
         "--itl-budget-ms", "40", "--kv-budget", "2048", "--max-tokens", "99", "--speculative", "prompt_lookup",
         "--cache-ram", "0", "--max-loaded-models", "2"]))
    assert (config.models, config.port, config.max_loaded_models) == (["a.gguf", "b.gguf"], 9000, 2)
    assert (config.engine.n_ctx, config.engine.kv_tokens, config.limits.max_tokens) == (512, 2048, 99)
    assert config.engine.scheduler == SchedulerConfig(max_num_seqs=7, itl_budget=0.04,
                                                      max_prefill_tokens_with_decodes=128)
    assert config.engine.speculative == SpeculativeConfig() and config.engine.prefix_tiers is None
    assert config.kv_events is None and config.scale_out is None
    with pytest.raises(SystemExit, match="--max-loaded-models"):
        serve_config(build_parser().parse_args(["serve", "--max-loaded-models", "0"]))
