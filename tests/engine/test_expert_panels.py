"""qwen3moe's (Q8_0, K-quant) and gpt-oss's (MXFP4) expert tensors in our panel GEMMs
(panels/expert_panels.c): packed at load, counted in Model.n_panel_packed, and giving
ggml_mul_mat_id's logits (and the float64 reference's) at one and many tokens per step, for many
sequences in one step, on every kernel."""

from pathlib import Path

import numpy as np
import pytest

from pyllama_paged._native import ffi, lib
from pyllama_paged.engine import EngineConfig, Model
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.testing.engine_runs import chunked_logits
from pyllama_paged.testing.routed_logits import ROUTER_NEAR_TIE, assert_one_step_routes_as_alone, file_logits, row_errors
from pyllama_paged.testing.reference.numpy_model import ReferenceModel
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.reference.tiny_gpt_oss import write_tiny_gpt_oss

N_LAYER = 2   # the tiny qwen3moe's
# test_engine_reference.py's tolerance with F16 KV, relative to the logits' spread
TOLERANCE = 2e-2
PROMPT = [int(x) for x in np.random.default_rng(3).integers(4, 200, size=40)]
# Expert type mixes as llama-quantize writes them: Q8_0; Q4_K_M's and Q5_K_M's Q4_K/Q5_K gate
# and up with a Q6_K down
WEIGHTS = {
    "q8_0": {"weight_type": "q8_0"},
    "q4_k_m": {"weight_type": "q4_k", "type_overrides": {"blk.*.ffn_down_exps.weight": "q6_k"}},
    "q5_k_m": {"weight_type": "q5_k", "type_overrides": {"blk.*.ffn_down_exps.weight": "q6_k"}},
}
# Everything but the experts in F32, which no panel takes: the experts are then all that
# packing changes.
EXPERTS_ONLY = {"blk.*.attn_*.weight": "f32", "output.weight": "f32", "token_embd.weight": "f32",
                "blk.*.ffn_down_exps.weight": "q6_k"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert-panels")
    files = {name: Path(write_tiny_model(root / f"qwen3moe-{name}.gguf", "qwen3moe", strict=True, **kw))
             for name, kw in WEIGHTS.items()}
    files["experts-only"] = Path(write_tiny_model(root / "qwen3moe-experts-only.gguf", "qwen3moe", strict=True,
                                                  weight_type="q4_k", type_overrides=EXPERTS_ONLY))
    return files


@pytest.fixture(scope="module")
def reference(tiny):
    out = {}
    for name, path in tiny.items():
        ref = ReferenceModel.from_gguf(path)
        out[name] = (ref.forward(PROMPT), ref.last_router_margin.copy())
    return out


def cpu_has_vnni() -> bool:
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    return {"avx512_vnni", "avx512vl"} <= flags or "avx_vnni" in flags


def cpu_has_avx2() -> bool:
    return "avx2=1" in ffi.string(lib.pp_ggml_build_info()).decode()


def packing(path, pack_panels=True):
    model = Model(path, pack_panels=pack_panels)
    try:
        return model.panel_kernel, model.n_panel_packed
    finally:
        model.close()


def engine_logits(path, chunks, pack_panels=True):
    return file_logits(path, PROMPT, chunks=chunks, pack_panels=pack_panels)


def skip_unless_packed(kernel):
    if kernel == "ggml":
        pytest.skip("no panel kernel takes these weights on this CPU")


@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_expert_tensors_are_packed_with_the_dense_weights(tiny, weights):
    """Every layer's gate, up and down expert tensors are packed (one weight each) beside q, k,
    v, o and the head; with pack_panels=False nothing is."""
    kernel, n_packed = packing(tiny[weights])
    assert packing(tiny[weights], pack_panels=False) == ("ggml", 0)
    if weights == "q8_0" and not cpu_has_vnni():
        assert n_packed == 0   # the AVX2 kernel takes no Q8_0 (pp_q8_panels_fit)
        return
    skip_unless_packed(kernel)
    assert n_packed == N_LAYER * 7 + 1


@pytest.mark.parametrize("chunks", [(23, 1, 16), ()], ids=["prefill-chunks", "one-token-steps"])
def test_expert_panels_alone_give_mul_mat_id_logits(tiny, reference, chunks):
    """With every other weight in F32, the expert panels are the only change packing makes:
    the logits move (panels ran, not ggml_mul_mat_id) but stay within the dense panels'
    tolerance of mul_mat_id's and the reference's, and (activations quantized per 32 values
    where GGML's Q8_K takes 256) no further from the reference than mul_mat_id's."""
    kernel, n_packed = packing(tiny["experts-only"])
    skip_unless_packed(kernel)
    assert n_packed == N_LAYER * 3
    want, margin = reference["experts-only"]
    near = margin < ROUTER_NEAR_TIE
    packed = engine_logits(tiny["experts-only"], chunks)
    plain = engine_logits(tiny["experts-only"], chunks, pack_panels=False)
    assert not np.array_equal(packed, plain)
    assert row_errors(packed, plain)[~near].max() < TOLERANCE
    assert row_errors(packed, want)[~near].max() < TOLERANCE
    assert np.abs(packed - want)[~near].max() <= 1.1 * np.abs(plain - want)[~near].max()


@pytest.mark.parametrize("chunks", [(23, 1, 16), ()], ids=["prefill-chunks", "one-token-steps"])
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_packed_moe_gives_mul_mat_id_and_reference_logits(tiny, reference, weights, chunks):
    """The whole model in panels (experts too) against GGML's own products and the reference,
    held as test_engine_reference.py holds the dense panels: Q8_0 panels take GGML's activation
    bytes and scales (only sums run in another order), so they give its logits; K-quant panels
    quantize activations per 32 values where GGML's Q8_K takes 256, so they are held to the
    reference instead (seen: 1.7-1.8% of the spread against GGML's 1.9-2.0%). Either way no
    further from it than GGML's products (the tiny Q8_0 model itself: 2.3% on both paths)."""
    kernel, _ = packing(tiny[weights])
    skip_unless_packed(kernel)
    want, margin = reference[weights]
    near = margin < ROUTER_NEAR_TIE
    packed = engine_logits(tiny[weights], chunks)
    plain = engine_logits(tiny[weights], chunks, pack_panels=False)
    if weights == "q8_0":
        assert row_errors(packed, plain)[~near].max() < TOLERANCE
    else:
        assert row_errors(packed, want)[~near].max() < TOLERANCE
    assert row_errors(packed, want)[~near].max() <= 1.1 * row_errors(plain, want)[~near].max()


@pytest.mark.parametrize("kernels", ["generic", "avx2"])
def test_expert_panels_on_the_portable_and_avx2_kernels(tiny, reference, monkeypatch, kernels):
    """The portable kernel (forced, packed with pack_panels="any-cpu") and the AVX2 one (the
    K-quants' kernel on CPUs without VNNI) multiply the experts too."""
    if kernels == "avx2" and not cpu_has_avx2():
        pytest.skip("the AVX2 kernel runs on AVX2 CPUs")
    monkeypatch.setenv("PYLLAMA_PAGED_KERNELS", kernels)
    pack = "any-cpu" if kernels == "generic" else True
    kernel, n_packed = packing(tiny["q4_k_m"], pack_panels=pack)
    assert (kernel, n_packed) == ({"generic": "portable", "avx2": "avx2"}[kernels], N_LAYER * 7 + 1)
    want, margin = reference["q4_k_m"]
    got = engine_logits(tiny["q4_k_m"], (23, 1, 16), pack_panels=pack)
    assert row_errors(got, want)[margin >= ROUTER_NEAR_TIE].max() < TOLERANCE


def panel_model(path) -> Model:
    """The model at path, its experts in our panels (a skip where no panel kernel takes them)."""
    model = Model(path)
    if model.panel_kernel == "ggml":
        model.close()
        pytest.skip("no panel kernel takes these weights on this CPU")
    return model


def routes_as_alone(path, low: int, high: int) -> None:
    """Seven sequences of several lengths (token ids in [low, high)) in one step through the
    panels: each one's logits are those it gets alone."""
    with panel_model(path) as model:
        assert_one_step_routes_as_alone(model, [
            [int(x) for x in np.random.default_rng(10 + i).integers(low, high, size=n)]
            for i, n in enumerate([3, 9, 17, 1, 30, 1, 1])])


@pytest.mark.parametrize("weights", ["q8_0", "q4_k_m"])
def test_many_sequences_in_one_step_route_as_alone_through_the_panels(tiny, weights):
    """A step's tokens from several sequences share each expert's panels (grouped by expert,
    prompts and single tokens mixed): each sequence's logits are those it gets alone."""
    routes_as_alone(tiny[weights], 4, 200)


def test_an_expert_routed_more_tokens_than_a_tile_holds_gives_the_short_runs_rows(tiny):
    """A 300-token prompt in one step routes about 75 tokens to each of 8 experts, more than the
    64 columns one kernel call takes (expert_panels.c's tile): its logits are those of the same
    prompt in 20-token steps (at most 40 columns an expert)."""
    model = panel_model(tiny["q4_k_m"])
    prompt = [int(x) for x in np.random.default_rng(5).integers(4, 200, size=300)]

    def all_logits(chunks):
        r = ModelRunner(model, EngineConfig(paged=True, n_ctx=320, n_threads=2, n_batch=320, block_size=16,
                                            kv_cache_type="f16"))
        try:
            return chunked_logits(r, prompt, chunks)
        finally:
            r.close()

    try:
        whole, short = all_logits((300,)), all_logits((20,) * 15)
        assert np.abs(whole - short).max() / (short.max() - short.min()) < 1e-3
    finally:
        model.close()


# ---- gpt-oss: MXFP4 experts in MXFP4 panels ------------------------------------------------

N_TEXT_TOKENS = 512 - 15   # the tiny gpt-oss's text tokens (o200k_harmony's specials above)
GPT_OSS_PROMPT = [int(x) for x in np.random.default_rng(1).integers(0, N_TEXT_TOKENS, size=40)]
# GGML's MXFP4 product quantizes its inputs to Q8_0 blocks, as the panels' columns are: only the
# sums' order differs (seen: under 1e-6 of the spread), but where that moves an activation across
# a rounding boundary of its block, one step of 1/127 of the block's largest (seen: 3.7e-4 in 2 of
# 300 rows). Most rows then agree to SAME_SUMS.
SAME_PRODUCTS = 2e-3
SAME_SUMS = 1e-5


def assert_same_products(got: np.ndarray, want: np.ndarray, rows: np.ndarray | None = None) -> None:
    errors = row_errors(got, want) if rows is None else row_errors(got, want)[rows]
    assert errors.max() < SAME_PRODUCTS and np.median(errors) < SAME_SUMS, (errors.max(), np.median(errors))


def _crowded(name, data):
    # every token's two experts are 0 and 1: 300 tokens are 300 columns each
    return data + np.where(np.arange(len(data)) < 2, 50.0, 0.0) if name.endswith("ffn_gate_inp.bias") else data


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """Tiny gpt-oss files with MXFP4 experts: its release's Q8_0 elsewhere; F32 elsewhere (no
    panel takes F32: the experts are all that packing changes); and one routing every token to
    experts 0 and 1."""
    root = tmp_path_factory.mktemp("expert-panels-gpt-oss")
    return {"q8_0": Path(write_tiny_gpt_oss(root / "gpt-oss-q8_0.gguf", weight_type="q8_0")),
            "experts-only": Path(write_tiny_gpt_oss(root / "gpt-oss-experts-only.gguf", weight_type="f32")),
            "crowded": Path(write_tiny_gpt_oss(root / "gpt-oss-crowded.gguf", weight_type="f32",
                                               tensor_hook=_crowded))}


@pytest.fixture(scope="module")
def gpt_oss_reference(gpt_oss):
    ref = ReferenceModel.from_gguf(gpt_oss["experts-only"])
    return ref.forward(GPT_OSS_PROMPT), ref.last_router_margin.copy()


def test_mxfp4_expert_tensors_are_packed_on_every_kernel(gpt_oss, monkeypatch):
    """gpt-oss's MXFP4 gate, up and down experts are packed (one weight each) on the VNNI, AVX2
    and portable kernels, beside its Q8_0 q, k, v, o and head where the kernel takes Q8_0 (VNNI,
    portable); with pack_panels=False nothing is."""
    assert packing(gpt_oss["q8_0"], pack_panels=False) == ("ggml", 0)
    kernel, n_packed = packing(gpt_oss["experts-only"])
    skip_unless_packed(kernel)
    assert n_packed == N_LAYER * 3
    assert packing(gpt_oss["q8_0"])[1] == (N_LAYER * 7 + 1 if cpu_has_vnni() else N_LAYER * 3)
    monkeypatch.setenv("PYLLAMA_PAGED_KERNELS", "generic")
    assert packing(gpt_oss["q8_0"], pack_panels="any-cpu") == ("portable", N_LAYER * 7 + 1)
    if cpu_has_avx2():
        monkeypatch.setenv("PYLLAMA_PAGED_KERNELS", "avx2")
        assert packing(gpt_oss["q8_0"]) == ("avx2", N_LAYER * 3)


@pytest.mark.parametrize("kernels", ["default", "generic", "avx2"])
@pytest.mark.parametrize("chunks", [(23, 1, 16), ()], ids=["prefill-chunks", "one-token-steps"])
def test_mxfp4_expert_panels_give_mul_mat_id_and_reference_logits(gpt_oss, gpt_oss_reference, monkeypatch,
                                                                   kernels, chunks):
    """With every other weight in F32 the MXFP4 expert panels are the only change packing
    makes: on each kernel (straight tiles for single tokens, widened ones for the 23- and
    16-token chunks) the logits move (panels ran, not ggml_mul_mat_id) but only by the sums'
    order, and are the reference's within the tolerance."""
    if kernels == "avx2" and not cpu_has_avx2():
        pytest.skip("the AVX2 kernel runs on AVX2 CPUs")
    if kernels != "default":
        monkeypatch.setenv("PYLLAMA_PAGED_KERNELS", kernels)
    pack = "any-cpu" if kernels == "generic" else True
    kernel, n_packed = packing(gpt_oss["experts-only"], pack_panels=pack)
    skip_unless_packed(kernel)
    assert n_packed == N_LAYER * 3
    want, margin = gpt_oss_reference
    near = margin < ROUTER_NEAR_TIE
    packed = file_logits(gpt_oss["experts-only"], GPT_OSS_PROMPT, chunks=chunks, pack_panels=pack)
    plain = file_logits(gpt_oss["experts-only"], GPT_OSS_PROMPT, chunks=chunks, pack_panels=False)
    assert not np.array_equal(packed, plain)
    assert_same_products(packed, plain, ~near)
    assert row_errors(packed, want)[~near].max() < TOLERANCE


def test_many_gpt_oss_sequences_in_one_step_route_as_alone_through_mxfp4_panels(gpt_oss):
    """Prompts and single tokens of several sequences in one step share the MXFP4 experts'
    panels: each sequence's logits are those it gets alone."""
    routes_as_alone(gpt_oss["q8_0"], 0, N_TEXT_TOKENS)


def test_mxfp4_experts_routed_more_columns_than_a_tile_holds(gpt_oss):
    """Every token routed to experts 0 and 1: a 300-token prompt in one step gives each 300
    columns (four 64-column kernel calls and a remainder), and the logits are those of 20-token
    steps and of ggml_mul_mat_id."""
    path = gpt_oss["crowded"]
    prompt = [int(x) for x in np.random.default_rng(5).integers(0, N_TEXT_TOKENS, size=300)]
    ref = ReferenceModel.from_gguf(path)
    ref.forward(prompt)
    # the raised pair wins every token in both layers, far from a tie (seen: 14 router logits)
    assert ref.last_router_margin.min() > 5

    def all_logits(chunks, pack_panels=True):
        model = Model(path, pack_panels=pack_panels)
        r = ModelRunner(model, EngineConfig(paged=True, n_ctx=320, n_threads=2, n_batch=320, block_size=16,
                                            kv_cache_type="f16"))
        try:
            return model.n_panel_packed, chunked_logits(r, prompt, chunks)
        finally:
            r.close()
            model.close()

    n_packed, whole = all_logits((300,))
    if n_packed == 0:
        pytest.skip("no panel kernel takes these weights on this CPU")
    _, short = all_logits((20,) * 15)
    _, plain = all_logits((300,), pack_panels=False)
    assert np.abs(whole - short).max() / (short.max() - short.min()) < 1e-3
    assert_same_products(whole, plain)
