"""The float64 reference of gemma4 (testing/reference/gemma4_reference.py) and the tiny gemma4
writer (tiny_gemma4.py): the files read as gguf-py reads them, the layer kinds and shared-KV
sources are llama.cpp's, and each of Gemma 4's pieces (proportional rope, K standing in for V,
the per-layer inputs, the MoE layer's router and experts beside the dense FFN) computes what
the module docstring says, checked against loops written out here."""
import math

import gguf
import numpy as np
import pytest

from pyllama_paged.testing.reference import gemma4_reference as g4
from pyllama_paged.testing.reference import numpy_model as ref
from pyllama_paged.testing.reference.loader import load_reference
from pyllama_paged.testing.reference.tiny_gemma4 import SHAPES, rope_divisors, write_tiny_gemma4

PROMPT = [int(x) for x in np.random.default_rng(1).integers(0, 300, size=30)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    return {shape: write_tiny_gemma4(root / f"{shape}.gguf", shape) for shape in SHAPES}


@pytest.fixture(scope="module")
def refs(files):
    return {shape: load_reference(path) for shape, path in files.items()}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_tiny_files_read_as_gguf_py_reads_them(files, refs, shape):
    reader = gguf.GGUFReader(files[shape])
    meta, _, _ = ref.read_gguf(files[shape])
    assert meta == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    r = refs[shape]
    assert isinstance(r, g4.Gemma4Reference) and r.arch == "gemma4"
    for t in reader.tensors:
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        np.testing.assert_array_equal(r.tensors[t.name], want.reshape(r.tensors[t.name].shape), err_msg=t.name)


def test_layer_kinds_shapes_and_kv_sources(refs):
    dense, moe = refs["dense"].layers, refs["moe"].layers
    assert [(l.sliding, l.head_dim, l.n_rot, l.n_head_kv, l.n_ff, l.kv_source) for l in dense] == [
        (True, 64, 64, 1, 512, 0), (True, 64, 64, 1, 512, 1), (False, 128, 128, 1, 512, 2),
        (True, 64, 64, 1, 512, 3), (True, 64, 64, 1, 512, 4), (False, 128, 128, 1, 512, 5),
        (True, 64, 64, 1, 1024, 4), (False, 128, 128, 1, 1024, 5)]
    assert [(l.n_head_kv, l.head_dim, l.rope_base) for l in moe] == [(4, 64, 1e4), (1, 128, 1e6)]


def test_shared_layers_read_what_llama_cpp_reuses():
    """llama.cpp gives a shared layer the KV of layer n_kv_from_start - 2 (sliding) or - 1
    (full); Gemma 4's layouts end their own-KV layers on a sliding then a full layer, where that
    is the last earlier layer of the same kind."""
    # E4B: five sliding layers then a full one, 18 of 42 shared; E2B: four then one, 15 of 35
    for n_layer, n_shared, period in ((42, 18, 6), (35, 15, 5)):
        sliding = [il % period < period - 1 for il in range(n_layer)]
        n_own = n_layer - n_shared
        want = list(range(n_own)) + [n_own - (2 if sliding[il] else 1) for il in range(n_own, n_layer)]
        assert g4.kv_sources(sliding, n_shared) == want
    with pytest.raises(ValueError, match="no earlier layer of its kind"):
        g4.kv_sources([True, True, False], 1)


def test_a_sequence_continued_through_its_kv_equals_one_run(refs):
    """Past the window, across shared layers (whose kv entries are their sources')."""
    for r in refs.values():
        whole = r.forward(PROMPT)
        first, kv = r.forward(PROMPT[:13], return_kv=True)
        rest, kv2 = r.forward(PROMPT[13:], past_kv=kv, return_kv=True)
        np.testing.assert_allclose(np.concatenate([first, rest]), whole, rtol=0, atol=1e-12 * np.abs(whole).max())
        for il, layer in enumerate(r.layers):
            assert kv2[il][0] is kv2[layer.kv_source][0] and kv2[il][0].shape == (len(PROMPT), layer.n_head_kv, layer.head_dim)


def test_proportional_rope_turns_only_the_rotated_quarter():
    x = np.random.default_rng(2).standard_normal((3, 2, 128))
    pos = [0, 7, 300]
    y = ref.rope(x, pos, n_rot=128, base=1e6, neox=True, freq_factors=rope_divisors(128))
    # NEOX pairs (i, i + 64): the first 16 pairs turn, the other 48 keep their values
    for i in range(64):
        pair = [i, i + 64]
        if i < 16:
            theta = np.array(pos, dtype=np.float64) * 1e6 ** (-2 * i / 128)
            want0 = x[..., i] * np.cos(theta)[:, None] - x[..., i + 64] * np.sin(theta)[:, None]
            np.testing.assert_allclose(y[..., i], want0, atol=1e-12)
        else:
            np.testing.assert_allclose(y[..., pair], x[..., pair], atol=1e-12)


def test_k_stands_in_for_a_missing_v_and_v_is_normed_without_weight(refs):
    r = refs["moe"]
    il = 1   # the full layer, which has no attn_v
    assert "blk.1.attn_v.weight" not in r.tensors and "blk.0.attn_v.weight" in r.tensors
    h = np.random.default_rng(3).standard_normal((5, r.n_embd))
    q, k, v = r._qkv(il, h, np.arange(5))
    raw = (h @ r.tensors["blk.1.attn_k.weight"].T.astype(np.float64)).reshape(5, 1, 128)
    np.testing.assert_allclose(v, raw / np.sqrt(np.mean(raw ** 2, axis=-1, keepdims=True) + r.rms_eps), rtol=1e-12)
    # k is the same projection, normed with its weight and turned: its norm per head is the normed one's
    kn = ref.rms_norm(raw, r.tensors["blk.1.attn_k_norm.weight"], r.rms_eps)
    assert not np.allclose(k, kn) and np.allclose(np.linalg.norm(k[:, :, :], axis=-1), np.linalg.norm(kn, axis=-1))


def test_per_layer_inputs_and_their_residual_by_hand(refs):
    r = refs["dense"]
    t, n_pl, n_layer = r.tensors, r.n_embd_per_layer, r.n_layer
    ids = np.array([5, 77, 300])
    x0 = t["token_embd.weight"][ids].astype(np.float64) * math.sqrt(r.n_embd)
    got = r.per_layer_inputs(ids, x0)
    for j, token in enumerate(ids):
        for il in range(n_layer):
            rows = slice(il * n_pl, (il + 1) * n_pl)
            proj = t["per_layer_model_proj.weight"][rows].astype(np.float64) @ x0[j] / math.sqrt(r.n_embd)
            proj = proj / math.sqrt(np.mean(proj ** 2) + r.rms_eps) * t["per_layer_proj_norm.weight"]
            table = t["per_layer_token_embd.weight"][token, rows].astype(np.float64) * math.sqrt(n_pl)
            np.testing.assert_allclose(got[j, il], (proj + table) / math.sqrt(2), rtol=1e-10)
    x = np.random.default_rng(4).standard_normal((3, r.n_embd))
    gate = ref.gelu_tanh(x @ t["blk.2.inp_gate.weight"].T.astype(np.float64)) * got[:, 2]
    want = ref.rms_norm(gate @ t["blk.2.proj.weight"].T.astype(np.float64), t["blk.2.post_norm.weight"], r.rms_eps)
    np.testing.assert_allclose(r._per_layer_embedding("blk.2.", x, got[:, 2]), want, rtol=1e-12)


def test_the_moe_layer_runs_its_dense_ffn_beside_the_experts_by_hand(refs):
    r = refs["moe"]
    t, p, eps = r.tensors, "blk.1.", r.rms_eps
    h = np.random.default_rng(5).standard_normal((4, r.n_embd)) * 3
    r.last_router_margin = np.full(4, np.inf)
    got = r._ffn(p, h)
    n_ff_exp = t[p + "ffn_gate_up_exps.weight"].shape[1] // 2
    for row in range(4):
        x = h[row]
        hn = x / math.sqrt(np.mean(x * x) + eps)
        dense_in = hn * t[p + "ffn_norm.weight"]
        dense = t[p + "ffn_down.weight"] @ (ref.gelu_tanh(t[p + "ffn_gate.weight"] @ dense_in) * (t[p + "ffn_up.weight"] @ dense_in))
        logits = t[p + "ffn_gate_inp.weight"] @ (hn / math.sqrt(r.n_embd) * t[p + "ffn_gate_inp.scale"])
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs, kind="stable")[:2]
        moe_in = hn * t[p + "pre_ffw_norm_2.weight"]
        experts = 0
        for e in top:
            gu = t[p + "ffn_gate_up_exps.weight"][e] @ moe_in
            act = ref.gelu_tanh(gu[:n_ff_exp]) * gu[n_ff_exp:]
            experts = experts + probs[e] / probs[top].sum() * (t[p + "ffn_down_exps.weight"][e] @ act) * \
                t[p + "ffn_down_exps.scale"][e]
        want = ref.rms_norm(dense, t[p + "post_ffw_norm_1.weight"], eps) + \
            ref.rms_norm(experts, t[p + "post_ffw_norm_2.weight"], eps)
        np.testing.assert_allclose(got[row], want, rtol=1e-6)


def test_separate_gate_and_up_experts_are_the_fused_ones_apart(tmp_path, refs):
    path = write_tiny_gemma4(tmp_path / "apart.gguf", "moe", fused_experts=False)
    apart = load_reference(path)
    assert "blk.0.ffn_gate_exps.weight" in apart.tensors and "blk.0.ffn_gate_up_exps.weight" not in apart.tensors
    logits = apart.forward(PROMPT[:8])
    assert np.isfinite(logits).all() and logits.std() > 0.5
