"""gemma4 in the engine against the float64 reference (testing/reference/gemma4_reference.py):
the tiny dense file (sliding and full layers of different head sizes, proportional rope, shared-KV
layers, per-layer embeddings, output scales) and the MoE one (per-layer KV heads, K standing in
for V, experts beside the dense FFN) on every attention path and KV layout, chunked prefill past
the window, a batch of sequences of different lengths, forks and preemption; each of Gemma 4's
features changes the logits and the engine follows it; the KV pools hold each layer's own row
width, and a shared-KV layer no rows at all."""
import os
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from pyllama_paged.engine import EngineConfig, Model, SamplingParams
from pyllama_paged.engine.kv.groups import KVGroups
from pyllama_paged.engine.worker.model_runner import ModelRunner, dense_kv_bytes_per_token, kv_groups_for, kv_row_bytes
from pyllama_paged.gguf.config import config_from_metadata
from pyllama_paged.gguf.reader import read_metadata
from pyllama_paged.testing import synthetic_gguf
from pyllama_paged.testing.agreement import (assert_forked_samples_agree, assert_greedy_agree,
                                              assert_preempted_answers_agree, reference_next_logits,
                                              small_engine)
from pyllama_paged.testing.reference.loader import load_reference
from pyllama_paged.testing.reference.tiny_gemma4 import write_tiny_gemma4
from pyllama_paged.testing.routed_logits import (ROUTER_NEAR_TIE, TOLERANCE, assert_one_step_routes_as_alone,
                                                 assert_routed_logits_match)
from pyllama_paged.testing.routed_logits import file_logits, relative_error
from pyllama_paged.testing.serving import free_port, stop_server, wait_healthy
from pyllama_paged.tokenizer.tokenizer import Tokenizer

PROMPT = [int(x) for x in np.random.default_rng(1).integers(0, 300, size=40)]   # the window of 8, five times
# Q8_0 weights: GGML rounds every product's activations to Q8_0 blocks, and the tiny Gemma 4's unscaled
# attention and a norm after every block pass that on (seen: 1.9% of the spread with an f16 KV, 2.7%
# in the MoE file); F16 weights meet TOLERANCE itself (0.05% and 0.5%)
Q8_WEIGHTS_TOLERANCE = {"f16": 4e-2, "q8_0": 8e-2}
# and they move the MoE file's router logits (rms-normed activations against a spread of ~6
# logits) further than routed_logits' near-tie allows for: a gap of 0.16 was seen to cross. With
# Q8_0 weights, a token routed within this many logits may take the other expert.
Q8_WEIGHTS_NEAR_TIE = 0.2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    return {(shape, wt): write_tiny_gemma4(root / f"{shape}-{wt}.gguf", shape, weight_type=wt)
            for shape in ("dense", "moe") for wt in ("f16", "q8_0")}


@pytest.fixture(scope="module")
def reference(tiny):
    return {key: load_reference(path) for key, path in tiny.items()}


@pytest.fixture(scope="module")
def want(reference):
    """Each file's reference logits of PROMPT, and its tokens' router margins."""
    out = {}
    for key, r in reference.items():
        out[key] = (r.forward(PROMPT), r.last_router_margin.copy())
    return out


def tolerance(weights: str, kv_cache_type: str) -> float:
    return (TOLERANCE if weights == "f16" else Q8_WEIGHTS_TOLERANCE)[kv_cache_type]


@pytest.mark.parametrize("shape", ["dense", "moe"])
@pytest.mark.parametrize("weights", ["f16", "q8_0"])
@pytest.mark.parametrize("kv_cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("paged,attention", [(True, "kernel"), (True, "gather"), (False, "kernel")])
def test_logits_match_reference(tiny, want, shape, weights, kv_cache_type, paged, attention):
    """Chunked prefill (23, 1 and 16 tokens) then single steps, past the window: our paged operator,
    the gathered pages through GGML's flash attention and the slab baseline."""
    logits, margin = want[shape, weights]
    if weights == "q8_0":   # the near-tie rule in routed_logits' units
        margin = margin * (ROUTER_NEAR_TIE / Q8_WEIGHTS_NEAR_TIE)
    got = file_logits(tiny[shape, weights], PROMPT, paged=paged, kv_cache_type=kv_cache_type, attention=attention)
    assert_routed_logits_match(got, logits, margin, tolerance(weights, kv_cache_type))


def test_panels_off_give_the_same_logits(tiny, want):
    """GGML's own products (no panels; the MoE file's dense FFN beside the experts never takes them)."""
    for shape in ("dense", "moe"):
        logits, margin = want[shape, "f16"]
        got = file_logits(tiny[shape, "f16"], PROMPT, pack_panels=False)
        assert_routed_logits_match(got, logits, margin, TOLERANCE["f16"])


@pytest.mark.parametrize("shape", ["dense", "moe"])
def test_a_batch_of_sequences_of_different_lengths_each_matches_its_solo_reference(tiny, reference, shape):
    """Four prompts prefilled in chunks together (they finish in different steps), then decoded
    together: every logits row is its own sequence's reference row."""
    r, path = reference[shape, "f16"], tiny[shape, "f16"]
    model = Model(path)
    runner = ModelRunner(model, EngineConfig(n_ctx=96, n_seq_max=4, n_threads=2, n_batch=64, block_size=16))
    try:
        prompts = [[int(x) for x in np.random.default_rng(30 + i).integers(0, 300, size=n)]
                   for i, n in enumerate([3, 12, 29, 45])]
        seqs = [runner.add_sequence(p) for p in prompts]
        kv = {}
        while any(s.num_computed < s.num_tokens for s in seqs):
            work = [(s, min(14, s.num_tokens - s.num_computed)) for s in seqs if s.num_computed < s.num_tokens]
            rows = iter(runner.step(work))
            for s, _ in work:
                if s.num_computed == s.num_tokens:
                    i = seqs.index(s)
                    ref_logits, kv[i] = r.forward(prompts[i], return_kv=True)
                    assert relative_error(next(rows)[None], ref_logits[-1:]) < TOLERANCE["f16"]
        last = {i: int(np.argmax(r.forward(prompts[i])[-1])) for i in range(4)}
        for _ in range(4):
            for i, s in enumerate(seqs):
                runner.append_tokens(s, [last[i]])
            rows = runner.step([(s, 1) for s in seqs])
            for i, row in enumerate(rows):
                ref_row, kv[i] = r.forward([last[i]], past_kv=kv[i], return_kv=True)
                assert relative_error(row[None], ref_row) < TOLERANCE["f16"]
                last[i] = int(np.argmax(ref_row[-1]))
    finally:
        runner.close()
        model.close()


def test_tokens_of_many_sequences_in_one_step_route_as_alone(tiny):
    model = Model(tiny["moe", "f16"])
    try:
        prompts = [[int(x) for x in np.random.default_rng(10 + i).integers(0, 300, size=n)]
                   for i, n in enumerate([3, 9, 17, 1, 30])]
        assert_one_step_routes_as_alone(model, prompts)
    finally:
        model.close()


# ---- the KV pools ----------------------------------------------------------------------------

def test_pools_hold_each_layers_own_width_and_shared_layers_none(tiny):
    """The dense file's sliding layers keep rows of 64 values, its full ones 128, and its two
    shared layers none: a token costs 4 x 64 + 2 x 128 values of K and as many of V. The groups
    (the full layers, the sliding ones) fill slots of one width: 2 x 128 = 4 x 64."""
    model = Model(tiny["dense", "f16"])
    try:
        cfg = model.config
        runner = ModelRunner(model, EngineConfig(n_ctx=64, n_threads=2, n_batch=64, block_size=16))
        assert runner.kv_groups == KVGroups((1, 1, 0, 1, 1, 0, 1, 0), (0, 8))
        assert runner.kv_bytes_per_token == 2 * kv_row_bytes("f16", 4 * 64 + 2 * 128)
        assert runner.kv_slot_bytes == 2 * kv_row_bytes("f16", 256)
        per_token = runner.kv_bytes_per_token
        runner.close()
        # without the shared layers' saving the two would each hold rows of their own
        assert sum(2 * kv_row_bytes("f16", cfg.kv_values(il)) for il in range(cfg.n_layer)) == \
               per_token + 2 * kv_row_bytes("f16", 64 + 128)
        slab = ModelRunner(model, EngineConfig(paged=False, n_ctx=64, n_threads=2, n_batch=64))
        assert slab.kv_bytes_per_token == per_token
        assert slab.kv_slot_bytes == slab.kv_bytes_per_token   # one group: every layer side by side
        slab.close()
    finally:
        model.close()


def test_groups_of_unequal_widths_fill_one_slot_width():
    """Gemma 4 26B-A4B: 25 sliding layers of 8 x 256 values, 5 full ones of 2 x 512: the full
    layers in one group of 5120 values a slot, the sliding ones in pairs (4096) wasting a fifth
    of their slots, which they hold only for their window; E4B: 20 sliding layers of 512 and 4
    full of 1024 with 18 layers shared: groups of 2048, nothing wasted."""
    sliding = [il % 6 < 5 for il in range(30)]
    g = KVGroups.for_layers([1024 if s else 0 for s in sliding], [2048 if s else 1024 for s in sliding])
    assert g.group_window == (0,) + (1024,) * 13 and g.slot_values([2048 if s else 1024 for s in sliding]) == 5120
    assert [g.layer_group[il] for il in range(30) if not sliding[il]] == [0] * 5
    sliding = [il % 6 < 5 for il in range(42)]
    source = [-1] * 24 + [22 if sliding[il] else 23 for il in range(24, 42)]
    widths = [512 if s else 1024 for s in sliding]
    g = KVGroups.for_layers([512 if s else 0 for s in sliding], widths, source)
    assert g.group_window == (0, 0, 512, 512, 512, 512, 512) and g.slot_values(widths, source) == 2048
    assert all(g.layer_group[il] == g.layer_group[source[il]] for il in range(24, 42))


@pytest.mark.parametrize("kv_cache_type", ["f16", "q8_0"])
def test_the_e4b_preset_keeps_kv_for_24_of_its_42_layers(tmp_path, kv_cache_type):
    """Gemma 4 E4B's real shapes (synthetic_gguf's preset, its metadata alone): 20 sliding layers
    of 2 x 256 values and 4 full ones of 2 x 512 keep KV; the 18 shared layers would add 15
    sliding and 3 full ones: 56 KiB a token in f16 instead of 98 KiB."""
    path = synthetic_gguf.write_metadata(tmp_path / "e4b.gguf", "gemma4-e4b")
    meta = read_metadata(path)
    cfg = config_from_metadata(meta, len(meta["tokenizer.ggml.tokens"]), path)
    assert (cfg.n_layer, cfg.layer_kv_source.count(-1), cfg.n_embd_per_layer) == (42, 24, 256)
    row = {"f16": 2, "q8_0": 34 / 32}[kv_cache_type]   # bytes a value
    kept = dense_kv_bytes_per_token(cfg, kv_cache_type)
    assert kept == 2 * row * (20 * 512 + 4 * 1024) == {"f16": 57344, "q8_0": 30464}[kv_cache_type]
    every = sum(2 * kv_row_bytes(kv_cache_type, cfg.kv_values(il)) for il in range(cfg.n_layer))
    assert every == 2 * row * (35 * 512 + 7 * 1024) == {"f16": 100352, "q8_0": 53312}[kv_cache_type]
    groups = kv_groups_for(cfg, paged=True, free_window_blocks=True)
    assert groups.n_groups == 7 and groups.slot_values([cfg.kv_values(il) for il in range(42)],
                                                       cfg.layer_kv_source) == 2048


def test_sliding_groups_give_their_blocks_back_past_the_window(tiny, reference):
    """A sequence of 100 tokens: the full group holds every block, the sliding group the window's,
    and the logits stay the reference's."""
    model = Model(tiny["dense", "f16"])
    runner = ModelRunner(model, EngineConfig(n_ctx=128, n_threads=2, n_batch=64, block_size=8))
    try:
        prompt = [int(x) for x in np.random.default_rng(7).integers(0, 300, size=100)]
        seq = runner.add_sequence(prompt)
        logits = runner.prefill(seq)
        held = [sum(1 for b in runner.kv.block_table(seq.handle, g) if b >= 0) for g in range(2)]
        assert held == [100 // 8 + 1, 2]   # window 8 over blocks of 8: the last one or two
        assert relative_error(logits[None], reference["dense", "f16"].forward(prompt)[-1:]) < TOLERANCE["f16"]
    finally:
        runner.close()
        model.close()


# ---- each feature decides ----------------------------------------------------------------------

def _hook(suffix, change):
    return {"tensor_hook": lambda name, d: change(d) if name.endswith(suffix) else d}


VARIANTS = {
    # the full layers' proportional rope: no pair turning where a quarter did
    "rope_freqs": ("dense", _hook("rope_freqs.weight", lambda d: np.full_like(d, 1e30))),
    # per-layer embeddings: the gate closed (gelu(0) = 0) adds nothing
    "per-layer embeddings": ("dense", _hook("inp_gate.weight", lambda d: 0 * d)),
    "output scales": ("dense", _hook("layer_output_scale.weight", lambda d: 0.5 * d)),
    "soft-cap": ("dense", {"final_logit_softcapping": 3.0}),
    "window": ("dense", {"sliding_window": 64}),   # wider than the prompt: every layer sees every key
    # unevenly: post_ffw_norm_2 would take a common factor back out
    "experts' output scales": ("moe", _hook("ffn_down_exps.scale", lambda d: d * np.where(np.arange(len(d)) % 2, 3, 1 / 3))),
    "router scale": ("moe", _hook("ffn_gate_inp.scale", lambda d: -d)),
    # the full layer with a V projection of its own, where K stood in
    "V of its own": ("moe", {"v_on_full": True}),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_feature_decides_and_the_engine_follows_it(tmp_path, want, name):
    """Each of Gemma 4's features changes the logits well beyond the tolerance, so an engine that
    ignored it could not pass test_logits_match_reference; the engine follows the changed file."""
    shape, changes = VARIANTS[name]
    path = write_tiny_gemma4(tmp_path / "variant.gguf", shape, weight_type="f16", **changes)
    changed_ref = load_reference(path)
    changed = changed_ref.forward(PROMPT)
    assert relative_error(changed, want[shape, "f16"][0]) > 5 * TOLERANCE["f16"]
    assert_routed_logits_match(file_logits(path, PROMPT), changed, changed_ref.last_router_margin, TOLERANCE["f16"])


# ---- forks and preemption ---------------------------------------------------------------------

PROMPTS = [[int(x) for x in np.random.default_rng(20 + i).integers(0, 300, size=n)]
           for i, n in enumerate([5, 17, 33, 48, 9, 60])]
GREEDY = SamplingParams(max_tokens=16, temperature=0)


@pytest.mark.parametrize("shape", ["dense", "moe"])
def test_parallel_samples_fork_and_copy_on_write_keep_the_reference_answer(tiny, reference, shape):
    model = Model(tiny[shape, "f16"])
    eot = Tokenizer.from_gguf(tiny[shape, "f16"]).eot_ids
    llm = small_engine(model, eot)
    try:
        assert_forked_samples_agree(llm, PROMPTS[2], reference[shape, "f16"], eot)
    finally:
        llm.runner.close()
        model.close()


def until_end(answer, end_ids):
    """A greedy answer as the engine gives it: up to its first end of generation, included."""
    end = next((i for i, t in enumerate(answer) if t in end_ids), len(answer) - 1)
    return answer[:end + 1]


# 24 tokens each: the sliding group gives back the blocks behind its window, and the growing full
# group's blocks outrun the pool's 9 (the longest alone needs 6 and 3)
LONG_GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def preempted_want(tiny, reference):
    """The dense file's greedy reference answers to PROMPTS, as the engine ends them."""
    eot = Tokenizer.from_gguf(tiny["dense", "f16"]).eot_ids
    return [until_end(reference["dense", "f16"].generate_greedy(p, LONG_GREEDY.max_tokens), eot) for p in PROMPTS]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_reference_answers(tiny, reference, preempted_want, mode):
    eot = Tokenizer.from_gguf(tiny["dense", "f16"]).eot_ids
    model = Model(tiny["dense", "f16"])
    llm = small_engine(model, eot, num_blocks=9, mode=mode)
    try:
        assert_preempted_answers_agree(llm, PROMPTS, LONG_GREEDY, reference["dense", "f16"], preempted_want, eot)
    finally:
        llm.runner.close()
        model.close()


# ---- llama.cpp ---------------------------------------------------------------------------------

# llama.cpp's tools, where bench/build_llama_cpp.sh builds them (or LLAMA_CPP_BIN names them)
LLAMA_CPP_BIN = Path(os.environ.get("LLAMA_CPP_BIN",
                                    Path(__file__).resolve().parents[2] / "bench" / ".llama.cpp" / "build" / "bin"))


@pytest.mark.parametrize("shape", ["dense", "moe"])
def test_llama_cpp_continues_as_the_reference(tmp_path, tiny, reference, shape):
    """llama.cpp's own gemma4 graph (llama-server, where built) gives the float64 reference's greedy
    continuation of the tiny files, up to a near-tie: the reference reads Gemma 4 as llama.cpp does
    (seen: 20 of 20 tokens the same, top probabilities within 5e-4)."""
    binary = LLAMA_CPP_BIN / "llama-server"
    if not binary.is_file():
        pytest.skip("llama-server is not built (bench/build_llama_cpp.sh builds it)")
    r, path = reference[shape, "f16"], tiny[shape, "f16"]
    prompt = [r.bos_id] + PROMPT[:24]
    url, log = f"http://127.0.0.1:{(port := free_port())}", tmp_path / "llama-server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(binary), "-m", path, "--port", str(port), "-t", "2", "-c", "256", "--no-warmup"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, "/health", timeout=120, log=log)
        body = {"prompt": prompt, "n_predict": 16, "cache_prompt": False, "return_tokens": True,
                "samplers": ["top_k"], "top_k": 1}
        got = httpx.post(f"{url}/completion", json=body, timeout=120).json()["tokens"]
    finally:
        stop_server(proc)
    eot = Tokenizer.from_gguf(path).eot_ids
    assert_greedy_agree(prompt, until_end(r.generate_greedy(prompt, 16), eot), got, reference_next_logits(r), eot)
