"""gpt-oss: its pieces in the float64 reference and the tiny writer (MXFP4 blocks as GGML lays
them out, checked against gguf-py's independent decoder; YaRN's rotary embedding; the clamped
SwiGLU and routing; sinks), then the whole model: a tiny gpt-oss file (MXFP4 experts, YaRN,
sinks, alternating sliding-window layers, biases everywhere) against the reference on every
attention path and KV layout, forks, preemption, the Llama API and the HTTP server in harmony,
and the errors of a broken gpt-oss file."""
import itertools
import json
import math
import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import openai
import pytest

from pyllama_paged._native import ffi, last_error, lib
from pyllama_paged.calls.chat_call import ChatCall, prepare_call
from pyllama_paged.api.llama import Llama
from pyllama_paged.engine import EngineConfig, Model, SamplingParams
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.errors import ModelLoadError
from pyllama_paged.testing import gguf_mutate, synthetic_gguf
from pyllama_paged.testing.agreement import (assert_forked_samples_agree, assert_greedy_agree,
                                              assert_preempted_answers_agree, reference_next_logits,
                                              small_engine)
from pyllama_paged.testing.engine_runs import chunked_logits, prompt_logits
from pyllama_paged.testing.routed_logits import TOLERANCE, assert_one_step_routes_as_alone, relative_error
from pyllama_paged.testing.routed_logits import assert_routed_logits_match as assert_logits_match
from pyllama_paged.testing.routed_logits import file_logits as engine_logits
from pyllama_paged.testing.reference import numpy_model as ref
from pyllama_paged.testing.reference.numpy_model import ReferenceModel
from pyllama_paged.testing.reference.tiny_gguf import dequantize_mxfp4, quantize_mxfp4, write_tiny_model
from pyllama_paged.testing.reference.tiny_gpt_oss import write_tiny_gpt_oss
from pyllama_paged.testing.scripted_gguf import HARMONY_TEMPLATE
from pyllama_paged.testing.serving import model_server
from pyllama_paged.tokenizer.chat_template import ChatTemplate
from pyllama_paged.tokenizer.tokenizer import Tokenizer
from pyllama_paged.tools.harmony import harmony_tokens, split_harmony


def test_mxfp4_blocks_decode_the_same_in_gguf_py():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((6, 64)) * np.array([1e-3, 0.1, 1, 7, 300, 0])[:, None]
    raw = quantize_mxfp4(rows)
    assert raw.shape == (6, 2 * 17) and raw.dtype == np.uint8
    ours = dequantize_mxfp4(raw)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(ours.astype(np.float32), theirs)
    # E2M1's widest gap (4 to 6) and the top clipped to 6 from below 8: at most 2 scale steps off
    step = np.exp2(raw[:, ::17].astype(np.float64) - 127).repeat(32, axis=1)
    assert np.all(np.abs(ours - rows) < 2 * step)
    assert np.all(ours[5] == 0)


def test_mxfp4_keeps_representable_values_exactly():
    codes = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6] * 2)
    for scale in (2.0 ** -20, 0.25, 1.0, 8.0):
        rows = (codes * scale)[None, :]
        np.testing.assert_array_equal(dequantize_mxfp4(quantize_mxfp4(rows)), rows)


def test_yarn_correction_dims_are_gpt_oss_20b_ones():
    # gpt-oss-20b: 64 rotated dims, 4096 original context, base 150000, beta 32 / 1
    assert ref.yarn_corr_dims(64, 4096, 150000.0, 32.0, 1.0) == (8.0, 18.0)


def test_yarn_extrapolates_fast_pairs_interpolates_slow_ones_and_scales_magnitude():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 64))
    pos = [0, 5, 1000]
    kw = dict(n_rot=64, base=150000.0, neox=True)
    plain = ref.rope(x, pos, **kw)
    interp = ref.rope(x, pos, freq_scale=1 / 32, **kw)
    assert np.allclose(ref.rope(x, pos, freq_scale=1 / 32, ext_factor=0.0, corr_dims=(8, 18), **kw), interp)
    yarn = ref.rope(x, pos, freq_scale=1 / 32, ext_factor=1.0, corr_dims=(8.0, 18.0), **kw)
    mscale = 1 + 0.1 * math.log(32)
    # pairs below the ramp keep the original angle, above it the interpolated one, both scaled
    np.testing.assert_allclose(yarn[..., :8], plain[..., :8] * mscale, atol=1e-12)
    np.testing.assert_allclose(yarn[..., 32:40], plain[..., 32:40] * mscale, atol=1e-12)
    np.testing.assert_allclose(yarn[..., 18:32], interp[..., 18:32] * mscale, atol=1e-12)
    # inside the ramp, neither
    assert not np.allclose(yarn[2, :, 12], plain[2, :, 12] * mscale)
    assert not np.allclose(yarn[2, :, 12], interp[2, :, 12] * mscale)


def test_swiglu_oai_clamps_gate_above_and_up_both_ways():
    gate = np.array([-3.0, 0.0, 2.0, 50.0])
    up = np.array([-50.0, 1.0, 3.0, 50.0])
    out = ref.swiglu_oai(gate, up)
    sig = 1 / (1 + np.exp(-1.702 * np.array([-3.0, 0.0, 2.0, 7.0])))
    np.testing.assert_allclose(out, np.array([-3.0, 0.0, 2.0, 7.0]) * sig * (np.array([-7.0, 1.0, 3.0, 7.0]) + 1))


def test_gpt_oss_routing_softmaxes_the_top_k_logits_with_biases():
    rng = np.random.default_rng(2)
    n_embd, n_ff, n_expert = 8, 6, 4
    h = rng.standard_normal((3, n_embd))
    router = rng.standard_normal((n_expert, n_embd))
    router_bias = np.array([0.0, 100.0, -100.0, 50.0])   # experts 1 and 3 win every row
    gate, up = rng.standard_normal((2, n_expert, n_ff, n_embd))
    down = rng.standard_normal((n_expert, n_embd, n_ff))
    gb, ub, db = rng.standard_normal((n_expert, n_ff)), rng.standard_normal((n_expert, n_ff)), rng.standard_normal((n_expert, n_embd))
    out = ref.gpt_oss_experts(h, router, router_bias, gate, gb, up, ub, down, db, n_used=2)
    for t in range(3):
        logits = router @ h[t] + router_bias
        w = np.exp(logits[[1, 3]] - logits[[1, 3]].max())
        w /= w.sum()
        want = sum(wi * (down[e] @ ref.swiglu_oai(gate[e] @ h[t] + gb[e], up[e] @ h[t] + ub[e]) + db[e])
                   for wi, e in zip(w, (1, 3)))
        np.testing.assert_allclose(out[t], want, rtol=1e-12)


def test_attention_sinks_are_a_zero_value_key_per_head():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((4, 4, 8)), rng.standard_normal((4, 2, 8)), rng.standard_normal((4, 2, 8))
    sinks = np.array([-1.0, 0.5, 3.0, -40.0])
    got = ref.attention(q, k, v, scale=0.35, sinks=sinks)
    # per head and query: the causal scores with the sink's logit joined, whose value row is 0
    for h in range(4):
        for t in range(4):
            scores = np.concatenate([[sinks[h]], 0.35 * k[: t + 1, h // 2] @ q[t, h]])
            p = np.exp(scores - scores.max())
            p /= p.sum()
            np.testing.assert_allclose(got[t, h], p[1:] @ v[: t + 1, h // 2], rtol=1e-12)
    assert np.allclose(got[:, 3], ref.attention(q, k, v, scale=0.35)[:, 3], atol=1e-15)
    assert not np.allclose(got[:, 2], ref.attention(q, k, v, scale=0.35)[:, 2])


# ---- the whole model ----------------------------------------------------------------------

# the tolerances and near-tie rules are test_moe.py's (pyllama_paged/testing/routed_logits.py)
# the tiny vocabulary: byte and merged tokens below this id, o200k_harmony's specials from it
N_TEXT_TOKENS = 512 - 15
PROMPT = [int(x) for x in np.random.default_rng(1).integers(0, N_TEXT_TOKENS, size=40)]
WINDOW = 8   # the tiny writer's sliding window: PROMPT crosses it five times


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny gpt-oss files with MXFP4 experts: Q8_0 attention, embedding and head, and F16 ones
    for the greedy answers (their logits are the reference's to well within a near-tie)."""
    root = tmp_path_factory.mktemp("gpt-oss")
    return {wt: Path(write_tiny_gpt_oss(root / f"gpt-oss-{wt}.gguf", weight_type=wt)) for wt in ("q8_0", "f16")}


@pytest.fixture(scope="module")
def model(tiny):
    with Model(tiny["f16"]) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def eot(tiny):
    return Tokenizer.from_gguf(str(tiny["f16"])).eot_ids


def mutated(tmp_path, source, ops, name="mutated.gguf"):
    doc = gguf_mutate.parse(Path(source).read_bytes())
    out = tmp_path / name
    out.write_bytes(gguf_mutate.build(doc, ops))
    return out


def test_the_tiny_file_reads_as_llama_cpp_reads_gpt_oss(tiny, reference):
    """The even layer slides over the window, every layer's rope is YaRN's (factor 32 over the
    original context, beta 32/1), attention is scaled by 1/sqrt(64), the experts are MXFP4."""
    model = Model(str(tiny["q8_0"]))
    try:
        cfg = model.config
        assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.head_dim, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == \
               ("gpt-oss", 2, 256, 64, 8, 2, 256)
        assert cfg.layer_window == [WINDOW, 0]
        assert (cfg.rope_freq_scale, cfg.rope_freq_scale_swa, cfg.rope_freq_base_swa) == (1 / 32, 1 / 32, 150000.0)
        assert (cfg.yarn_ext_factor, cfg.yarn_attn_factor, cfg.n_ctx_orig_yarn, cfg.n_ctx_train) == (1.0, 1.0, 256, 8192)
        assert cfg.attn_scale == pytest.approx(1 / 8)
    finally:
        model.close()
    r = reference["q8_0"]
    assert [layer.sliding for layer in r.layers] == [True, False]
    assert all(layer.yarn_ext_factor == 1.0 and layer.yarn_corr_dims == (0.0, 10.0) for layer in r.layers)
    _, infos, _ = ref.read_gguf(tiny["q8_0"])
    types = {i.name: i.qtype for i in infos}
    assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.0.attn_sinks.weight"] == types["blk.0.ffn_gate_exps.bias"] == gguf.GGMLQuantizationType.F32


def test_the_reference_reads_the_file_as_gguf_py_and_continues_a_sequence_exactly(tiny, reference):
    """The reference's reader and tensors are gguf-py's (MXFP4 experts included), and a prompt
    run in pieces through its KV (past the window, sinks in every softmax) gives the logits
    of one whole run."""
    path = str(tiny["q8_0"])
    reader = gguf.GGUFReader(path)
    meta, infos, _ = ref.read_gguf(path)
    assert meta == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    r = reference["q8_0"]
    for t in reader.tensors:
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        np.testing.assert_array_equal(r.tensors[t.name], want.reshape(r.tensors[t.name].shape), err_msg=t.name)
    whole = r.forward(PROMPT)
    first, kv = r.forward(PROMPT[:13], return_kv=True)
    rest = r.forward(PROMPT[13:], past_kv=kv)
    np.testing.assert_allclose(np.concatenate([first, rest]), whole, rtol=0, atol=1e-12 * np.abs(whole).max())


def test_the_swiglu_clamp_decides_where_it_is_reached(tmp_path, reference, monkeypatch):
    """Experts scaled up threefold send a few percent of their pre-activations past the clamp at
    7: the reference with the clamp lifted gives other logits, and the engine gives the clamped
    ones. F16 experts: GGML feeds an MXFP4 or Q8_0 product Q8_0 inputs, whose 32-value blocks
    round the small values of so wide a range coarsely (seen: 2% of the spread)."""
    path = write_tiny_gpt_oss(tmp_path / "wide.gguf", weight_type="f16", expert_type="f16",
                              tensor_hook=lambda name, d: 3 * d if name.endswith(("gate_exps.weight", "up_exps.weight"))
                              else d)
    wide = ReferenceModel.from_gguf(path)
    t = wide.tensors
    norm = t["blk.0.post_attention_norm.weight"]
    h = ref.rms_norm(np.random.default_rng(5).standard_normal((64, len(norm))), norm, 1e-5)
    gate = np.einsum("td,efd->tef", h, t["blk.0.ffn_gate_exps.weight"]) + t["blk.0.ffn_gate_exps.bias"]
    assert 0.005 < np.mean(gate > 7) < 0.1
    clamped = wide.forward(PROMPT)
    monkeypatch.setattr(ref, "swiglu_oai", lambda g, u: ref.silu(1.702 * g) / 1.702 * (u + 1))
    assert relative_error(wide.forward(PROMPT), clamped) > 5 * TOLERANCE["f16"]
    monkeypatch.undo()
    assert_logits_match(engine_logits(path, PROMPT), clamped, wide.last_router_margin, TOLERANCE["f16"])


@pytest.mark.parametrize("weights", ["q8_0", "f16"])
@pytest.mark.parametrize("kv_cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("paged,attention", [(True, "kernel"), (True, "gather"), (False, "kernel")])
def test_logits_match_reference(tiny, reference, weights, kv_cache_type, paged, attention):
    """Our paged operator, the gathered pages through GGML's flash attention and the slab
    baseline give the reference's logits: sinks, windows, YaRN, biases and MXFP4 experts."""
    r = reference[weights]
    want = r.forward(PROMPT)
    got = engine_logits(tiny[weights], PROMPT, paged=paged, kv_cache_type=kv_cache_type, attention=attention)
    assert_logits_match(got, want, r.last_router_margin, TOLERANCE[kv_cache_type])


def _without_sinks(tmp_path, tiny):
    # -30 next to scores of a few units: no share of any softmax
    return write_tiny_gpt_oss(tmp_path / "nosinks.gguf", weight_type="f16",
                              tensor_hook=lambda name, d: np.full_like(d, -30.0) if "attn_sinks" in name else d)


VARIANTS = {
    "sinks": _without_sinks,
    # a window wider than the prompt: every layer sees every key
    "window": lambda tmp_path, tiny: mutated(tmp_path, tiny["f16"], [
        ["kv", "gpt-oss.attention.sliding_window", gguf_mutate.U32, 64]]),
    # both layers slide, not only layer 0
    "pattern": lambda tmp_path, tiny: mutated(tmp_path, tiny["f16"], [
        ["kv", "gpt-oss.attention.sliding_window_pattern", gguf_mutate.U32, 3]]),
    # as booleans per layer: neither layer slides
    "pattern array": lambda tmp_path, tiny: mutated(tmp_path, tiny["f16"], [
        ["kv", "gpt-oss.attention.sliding_window_pattern", gguf_mutate.ARRAY,
         {"etype": gguf_mutate.BOOL, "items": [False, False]}]]),
    # factor 1: plain rope
    "yarn": lambda tmp_path, tiny: mutated(tmp_path, tiny["f16"], [
        ["kv", "gpt-oss.rope.scaling.factor", gguf_mutate.F32, 1.0]]),
    # the router's bias flipped: other experts
    "router bias": lambda tmp_path, tiny: write_tiny_gpt_oss(
        tmp_path / "flipped.gguf", weight_type="f16",
        tensor_hook=lambda name, d: -8 * d if name.endswith("ffn_gate_inp.bias") else d),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_feature_decides_and_the_engine_follows_it(tmp_path, tiny, reference, variant):
    """Each of gpt-oss's features changes the logits well beyond the tolerance, so a file where
    the engine ignored it could not pass test_logits_match_reference; the engine follows the
    changed file too."""
    path = VARIANTS[variant](tmp_path, tiny)
    base = reference["f16"].forward(PROMPT)
    changed_ref = ReferenceModel.from_gguf(path)
    changed = changed_ref.forward(PROMPT)
    assert relative_error(changed, base) > 5 * TOLERANCE["f16"]
    got = engine_logits(path, PROMPT)
    assert_logits_match(got, changed, changed_ref.last_router_margin, TOLERANCE["f16"])


def test_experts_are_read_from_their_mxfp4_blocks(tmp_path, tiny, reference):
    """The same draws with Q8_0 experts give other logits (MXFP4's 4-bit rounding is coarser), and
    the engine follows each file: it decodes MXFP4 as the reference does, not as another type."""
    q8 = write_tiny_gpt_oss(tmp_path / "q8-experts.gguf", weight_type="f16", expert_type="q8_0")
    q8_ref = ReferenceModel.from_gguf(q8)
    assert relative_error(q8_ref.forward(PROMPT), reference["f16"].forward(PROMPT)) > 2 * TOLERANCE["f16"]
    assert_logits_match(engine_logits(q8, PROMPT), q8_ref.forward(PROMPT), q8_ref.last_router_margin,
                        TOLERANCE["f16"])


@pytest.mark.parametrize("weights", ["q8_0", "mxfp4"])
def test_panels_take_the_q8_0_and_mxfp4_projections(tmp_path, weights):
    """Our panel GEMMs (any CPU: the portable kernel where no SIMD one runs) take gpt-oss's Q8_0
    projections and head, with the biases added after them, and its MXFP4 ones (the experts'
    type given to every matrix): each layer's q, k, v, o and three expert tensors, and the
    head. Both give the reference's logits."""
    path = write_tiny_gpt_oss(tmp_path / f"{weights}.gguf", weight_type=weights)
    r = ReferenceModel.from_gguf(path)
    model = Model(path, pack_panels="any-cpu")
    runner = ModelRunner(model, EngineConfig(n_ctx=64, n_threads=2, n_batch=64, block_size=16))
    try:
        # the AVX2 kernel (CPUs without VNNI) takes no Q8_0: the experts alone
        every = weights == "mxfp4" or model.panel_kernel != "avx2"
        assert model.n_panel_packed == (r.n_layer * 7 + 1 if every else r.n_layer * 3)
        got = chunked_logits(runner, PROMPT)
    finally:
        runner.close()
        model.close()
    # MXFP4 products (GGML's and the panels') round their inputs to Q8_0 blocks, the attention's
    # too here: the tolerance of a Q8_0 KV (seen: 5% of the spread at worst, 0.6% typically)
    tolerance = TOLERANCE["q8_0" if weights == "mxfp4" else "f16"]
    assert_logits_match(got, r.forward(PROMPT), r.last_router_margin, tolerance)


def test_tokens_of_many_sequences_in_one_step_route_as_alone(model):
    """A step's tokens from several sequences go through the experts together: each sequence's
    logits are those it gets alone, its sliding windows and sinks its own."""
    prompts = [[int(x) for x in np.random.default_rng(10 + i).integers(0, N_TEXT_TOKENS, size=n)]
               for i, n in enumerate([3, 9, 17, 1, 30])]

    assert_one_step_routes_as_alone(model, prompts)


PROMPTS = [[int(x) for x in np.random.default_rng(20 + i).integers(0, N_TEXT_TOKENS, size=n)]
           for i, n in enumerate([5, 17, 33, 48, 9, 60])]
# 40 tokens each: the sliding layer gives back the blocks behind its window, and with 16 the six
# requests fit the 12 blocks without a preemption
GREEDY = SamplingParams(max_tokens=40, temperature=0)


@pytest.fixture(scope="module")
def reference_answers(reference):
    return [reference["f16"].generate_greedy(p, GREEDY.max_tokens) for p in PROMPTS]


def test_parallel_samples_fork_and_copy_on_write_keep_the_reference_answer(model, reference, eot):
    """n=3 greedy samples share the prompt's pages, copy the partial last block on their first
    write, and each continues as the reference does."""
    with small_engine(model, eot) as llm:   # 2 full blocks and a partial one
        assert_forked_samples_agree(llm, PROMPTS[2], reference["f16"], eot)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_reference_answers(model, reference, reference_answers, eot, mode):
    llm = small_engine(model, eot, num_blocks=12, mode=mode)
    try:
        assert_preempted_answers_agree(llm, PROMPTS, GREEDY, reference["f16"], reference_answers, eot)
    finally:
        llm.runner.close()


HELLO = [{"role": "user", "content": "Hello"}]
N_REPLY = 12


def test_llama_api_and_http_server_answer_in_harmony_as_the_reference(tiny, reference, eot):
    """The file's harmony template renders the chat; the reply to it is the reference's greedy
    one, and comes back split as harmony (analysis as thinking, the rest as the answer) from
    Llama.create_chat_completion and from /v1/chat/completions (the real openai client)."""
    path = str(tiny["f16"])
    tokenizer = Tokenizer.from_gguf(path)
    assert ref.read_gguf(path)[0]["tokenizer.chat_template"] == HARMONY_TEMPLATE
    prompt = prepare_call(ChatCall(messages=HELLO), ChatTemplate(HARMONY_TEMPLATE), tokenizer).prompt_ids
    assert tokenizer.decode(prompt).endswith("<|start|>assistant")
    llm = Llama(model_path=path, n_ctx=256, n_threads=2, verbose=False)
    try:
        got = list(itertools.islice(llm.generate(prompt, temp=0), N_REPLY))
        r = reference["f16"]
        assert_greedy_agree(prompt, r.generate_greedy(prompt, N_REPLY), got, reference_next_logits(r), eot)
        reply = list(itertools.takewhile(lambda t: t not in eot, got))
        thinking, answer, _ = split_harmony(reply, harmony_tokens(tokenizer), set())
        message = llm.create_chat_completion(HELLO, max_tokens=N_REPLY, temperature=0)["choices"][0]["message"]
        assert (message.get("reasoning_content") or "", message["content"] or "") == (thinking, answer)
    finally:
        llm.close()
    with model_server([path], n_ctx=256, n_threads=2, n_batch=64) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        name = client.models.list().data[0].id
        out = client.chat.completions.create(model=name, messages=HELLO, max_tokens=N_REPLY, temperature=0)
        m = out.choices[0].message
        assert ((m.model_extra or {}).get("reasoning_content") or "", m.content or "") == (thinking, answer)


# ---- the real shapes ----------------------------------------------------------------------

# llama.cpp's tools, where bench/build_llama_cpp.sh builds them (or LLAMA_CPP_BIN names them)
LLAMA_CPP_BIN = Path(os.environ.get("LLAMA_CPP_BIN",
                                    Path(__file__).resolve().parents[2] / "bench" / ".llama.cpp" / "build" / "bin"))


def test_the_gpt_oss_20b_preset_shrinks_and_takes_shape_flags(tmp_path):
    """synthetic_gguf's gpt-oss-20b preset, shrunk (--small) and reshaped by its flags, is a gpt-oss
    file of those shapes, o200k_harmony's vocabulary and gpt-oss's rope and windows, that the
    engine loads and runs; llama.cpp's llama-bench runs it too where it is built."""
    out = tmp_path / "gpt-oss.gguf"
    assert synthetic_gguf.main(["--preset", "gpt-oss-20b", "--small", "--n-expert", "8", "--n-expert-used", "2",
                                "--out", str(out)]) == 0
    model = Model(str(out))
    try:
        cfg = model.config
        assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.head_dim, cfg.n_head // cfg.n_head_kv, cfg.n_vocab,
                cfg.n_ctx_train) == ("gpt-oss", 2, 512, 64, 8, 201088, 131072)
        assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.layer_window) == (8, 2, 256, [128, 0])
        assert (cfg.rope_freq_scale, cfg.yarn_ext_factor, cfg.n_ctx_orig_yarn) == (1 / 32, 1.0, 4096)
        logits = prompt_logits(model, range(100, 120))
        assert logits.shape == (201088,) and np.isfinite(logits).all() and logits.std() > 0.5
    finally:
        model.close()
    bench = LLAMA_CPP_BIN / "llama-bench"
    if bench.is_file():
        run = subprocess.run([str(bench), "-m", str(out), "-p", "0", "-n", "4", "-t", "2", "-r", "1", "-o", "json"],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        assert [r["n_gen"] for r in json.loads(run.stdout)] == [4]


# ---- broken files -----------------------------------------------------------------------

@pytest.mark.parametrize("ops,message", [
    gguf_mutate.missing_tensor_case("blk.1.attn_sinks.weight"),
    gguf_mutate.missing_tensor_case("blk.0.attn_output.bias"),
    gguf_mutate.missing_tensor_case("blk.1.attn_k.bias"),
    gguf_mutate.missing_tensor_case("blk.0.ffn_gate_inp.bias"),
    gguf_mutate.missing_tensor_case("blk.1.ffn_down_exps.bias"),
    gguf_mutate.missing_tensor_case("blk.0.post_attention_norm.weight"),
    gguf_mutate.missing_tensor_case("blk.1.ffn_up_exps.weight"),
    ([["kv", "gpt-oss.expert_count", gguf_mutate.U32, 4]],
     r"tensor 'blk\.0\.ffn_gate_inp\.weight': shape \[256, 8\] but the hyper-parameters need \[256, 4\]"),
    ([["kv", "gpt-oss.expert_used_count", gguf_mutate.U32, 9]],
     r"'gpt-oss\.expert_used_count' is 9, more than the 8 experts of 'gpt-oss\.expert_count'"),
    ([["kv", "gpt-oss.attention.head_count", gguf_mutate.U32, 16]],
     r"tensor 'blk\.0\.attn_q\.weight': shape \[256, 512\] but the hyper-parameters need \[256, 1024\]"),
    ([["kv_drop", "gpt-oss.attention.sliding_window"]], r"missing metadata field 'gpt-oss\.attention\.sliding_window'"),
    ([["kv", "gpt-oss.attention.sliding_window_pattern", gguf_mutate.ARRAY, {"etype": gguf_mutate.BOOL, "items": [True]}]],
     r"'gpt-oss\.attention\.sliding_window_pattern' must be 2 booleans, got an array of 1"),
    ([["kv", "gpt-oss.rope.scaling.yarn_log_multiplier", gguf_mutate.F32, 0.1]],
     r"'gpt-oss\.rope\.scaling\.yarn_log_multiplier' is set; YaRN with a log multiplier is not supported"),
])
def test_a_broken_gpt_oss_file_is_refused_precisely(tmp_path, tiny, ops, message):
    with pytest.raises(ModelLoadError, match=message):
        Model(str(mutated(tmp_path, tiny["q8_0"], ops)))


def test_an_expert_bias_not_in_f32_is_refused(tmp_path, tiny):
    """ggml_add_id takes f32 biases only: a 2-D bias of another type is refused at load, not in a graph."""
    # retyped in place (its f32 bytes then hold the f16 tensor and more): the type is refused first
    path = mutated(tmp_path, tiny["q8_0"], [["tensor", "blk.0.ffn_up_exps.bias", "ttype",
                                             int(gguf.GGMLQuantizationType.F16)]])
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.0\.ffn_up_exps\.bias': type f16, but norm weights "
                                             r"and biases must be f32"):
        Model(str(path))


def test_yarn_is_refused_for_an_architecture_not_checked_with_it(tmp_path):
    path = write_tiny_model(tmp_path / "qwen3.gguf", "qwen3")
    broken = mutated(tmp_path, path, [["kv", "qwen3.rope.scaling.type", gguf_mutate.STRING, "yarn"],
                                      ["kv", "qwen3.rope.scaling.factor", gguf_mutate.F32, 4.0]])
    with pytest.raises(ModelLoadError, match=r"rope scaling 'yarn' is supported for gpt-oss only, not 'qwen3'"):
        Model(str(broken))


@pytest.mark.parametrize("fields,message", [
    ({"yarn_ext_factor": 2.0}, "yarn_ext_factor 2 must be in [0, 1]"),
    ({"yarn_ext_factor": float("nan")}, "yarn_ext_factor nan must be in [0, 1]"),
    ({"yarn_ext_factor": 1.0, "yarn_beta_fast": 1.0, "yarn_beta_slow": 32.0},
     "yarn_beta_fast 1 must be above yarn_beta_slow 32, both positive"),
    ({"yarn_attn_factor": -1.0}, "yarn_attn_factor -1 must be finite and >= 0"),
    ({"rope_freq_scale_swa": float("nan")}, "rope_freq_scale_swa nan must be finite and >= 0"),
    ({"n_ctx_orig_yarn": -5}, "n_ctx_orig_yarn -5 must be >= 0"),
])
def test_the_native_core_checks_the_yarn_fields_itself(fields, message):
    """pp_model_create refuses what config_from_metadata never hands it."""
    hp = {"arch": lib.PP_ARCH_GPT_OSS, "n_layer": 1, "n_embd": 64, "n_head": 2, "n_head_kv": 1, "head_dim": 32,
          "n_ff": 64, "n_vocab": 300, "n_ctx_train": 64, "rope_type": 2, "rope_freq_base": 1e4,
          "rope_freq_scale": 0.25, "rms_eps": 1e-6, "attn_scale": 1.0, "embd_scale": 1.0, "n_expert": 4,
          "n_expert_used": 2, "n_ff_exp": 32, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0}
    out = ffi.new("pp_model **")
    assert lib.pp_model_create(ffi.new("pp_model_hparams *", {**hp, **fields}), out) == lib.PP_ERR_INVALID
    assert message in last_error()
