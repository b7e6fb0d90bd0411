"""Self-checks of the float64 reference of Qwen3.5/3.6's hybrids
(pyllama_paged/testing/reference/delta_net.py, hybrid_model.py) and of their tiny writer
(tiny_qwen35.py): the delta rule's recurrent form against a chunked form written apart, the
convolution against numpy's, IMRoPE against plain RoPE, a gated attention layer against a
loop, and a decode from carried state against one prefill."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from pyllama_paged.testing.reference import delta_net as dn
from pyllama_paged.testing.reference.hybrid_model import HybridReferenceModel, hybrid_state_bytes
from pyllama_paged.testing.reference.numpy_model import ReferenceModel, read_gguf, rms_norm, rope
from pyllama_paged.testing.reference.tiny_qwen35 import write_tiny_qwen35

QT = gguf.GGMLQuantizationType


def _delta_inputs(rng, n, n_k_heads=2, n_v_heads=4, d=16):
    q = dn.l2_normalize(rng.standard_normal((n, n_k_heads, d)), 1e-6)
    k = dn.l2_normalize(rng.standard_normal((n, n_k_heads, d)), 1e-6)
    v = rng.standard_normal((n, n_v_heads, d))
    g = -rng.uniform(0.001, 1.0, (n, n_v_heads))
    beta = rng.uniform(0.05, 0.95, (n, n_v_heads))
    s0 = 0.3 * rng.standard_normal((n_v_heads, d, d))
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("n,chunk", [(1, 16), (7, 16), (16, 16), (37, 16), (37, 5), (64, 64)])
def test_delta_rule_recurrent_equals_chunked(n, chunk):
    q, k, v, g, beta, s0 = _delta_inputs(np.random.default_rng(n * 100 + chunk), n)
    out_r, s_r = dn.delta_rule_recurrent(q, k, v, g, beta, s0)
    out_c, s_c = dn.delta_rule_chunked(q, k, v, g, beta, s0, chunk=chunk)
    np.testing.assert_allclose(out_c, out_r, rtol=0, atol=1e-10)
    np.testing.assert_allclose(s_c, s_r, rtol=0, atol=1e-10)


def test_delta_rule_carried_state_equals_one_run():
    q, k, v, g, beta, s0 = _delta_inputs(np.random.default_rng(3), 30)
    whole, s_whole = dn.delta_rule_recurrent(q, k, v, g, beta, s0)
    cut = 11
    a, s_mid = dn.delta_rule_recurrent(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], s0)
    b, s_end = dn.delta_rule_chunked(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], s_mid, chunk=8)
    np.testing.assert_allclose(np.concatenate([a, b]), whole, atol=1e-10)
    np.testing.assert_allclose(s_end, s_whole, atol=1e-10)


def test_value_heads_read_key_heads_tiled():
    """Value head h uses query/key head h % H_k (GGML's broadcast), the same as repeating the
    key heads as whole blocks."""
    q, k, v, g, beta, s0 = _delta_inputs(np.random.default_rng(4), 9, n_k_heads=2, n_v_heads=6)
    out, s = dn.delta_rule_recurrent(q, k, v, g, beta, s0)
    tiled_q, tiled_k = np.concatenate([q, q, q], axis=1), np.concatenate([k, k, k], axis=1)
    want, want_s = dn.delta_rule_recurrent(tiled_q, tiled_k, v, g, beta, s0)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(s, want_s, atol=1e-12)


def test_one_delta_step_by_hand():
    """One token, one head, written out: S = e^g S0 + beta k (v - e^g S0^T k)^T, o = S^T q / sqrt(d)."""
    q, k, v, g, beta, s0 = _delta_inputs(np.random.default_rng(5), 1, n_k_heads=1, n_v_heads=1, d=4)
    out, s = dn.delta_rule_recurrent(q, k, v, g, beta, s0)
    decayed = math.exp(g[0, 0]) * s0[0]
    kk, vv, qq = k[0, 0], v[0, 0], q[0, 0]
    want_s = decayed + beta[0, 0] * np.outer(kk, vv - decayed.T @ kk)
    np.testing.assert_allclose(s[0], want_s, atol=1e-14)
    np.testing.assert_allclose(out[0, 0], want_s.T @ qq / 2.0, atol=1e-14)
    # GGML's layout: a row per value dimension
    np.testing.assert_allclose(dn.state_to_ggml(s).reshape(4, 4), want_s.T, atol=1e-14)


def test_causal_conv_with_state_matches_numpy_convolve():
    rng = np.random.default_rng(6)
    n, channels, d_conv = 23, 5, 4
    x, w = rng.standard_normal((n, channels)), rng.standard_normal((channels, d_conv))
    state0 = rng.standard_normal((d_conv - 1, channels))
    out, state = dn.causal_conv(x, w, state0)
    ext = np.concatenate([state0, x])
    for c in range(channels):
        # output t = sum_k ext[t + k] w[k]: numpy's correlation, i.e. convolution with w reversed
        np.testing.assert_allclose(out[:, c], np.convolve(ext[:, c], w[c, ::-1], mode="valid"), atol=1e-12)
    np.testing.assert_array_equal(state, x[-(d_conv - 1):])
    # in pieces, the state carried
    a, mid = dn.causal_conv(x[:2], w, state0)
    b, end = dn.causal_conv(x[2:], w, mid)
    np.testing.assert_allclose(np.concatenate([a, b]), out, atol=1e-12)
    np.testing.assert_array_equal(end, state)


def test_imrope_is_neox_rope_when_sections_cover_every_pair():
    """Text tokens give the three sections one position: where every pair lies in one (sections
    summing to n_rot / 2, the fourth empty), IMRoPE is NEOX RoPE over the first n_rot dims."""
    rng = np.random.default_rng(7)
    x, pos = rng.standard_normal((6, 3, 32)), [0, 1, 5, 17, 100, 4095]
    got = dn.imrope(x, pos, n_rot=16, sections=(3, 3, 2, 0), base=1e7)
    np.testing.assert_allclose(got, rope(x, pos, n_rot=16, base=1e7, neox=True), atol=1e-12)


def test_imrope_leaves_pairs_of_the_fourth_component_unrotated():
    """Pairs whose sector falls to the fourth position component read 0 for text: no rotation."""
    rng = np.random.default_rng(8)
    x, pos = rng.standard_normal((4, 2, 16)), [3, 9, 20, 50]
    got = dn.imrope(x, pos, n_rot=16, sections=(1, 1, 2, 0), base=1e4)   # sector 3 of 4: the fourth
    full = rope(x, pos, n_rot=16, base=1e4, neox=True)
    for pair in range(8):
        dims = [pair, pair + 8]
        want = x[..., dims] if pair % 4 == 3 else full[..., dims]
        np.testing.assert_allclose(got[..., dims], want, atol=1e-12)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {arch: write_tiny_qwen35(root / f"{arch}.gguf", arch) for arch in ("qwen35", "qwen35moe")}


def test_gated_attention_layer_against_a_loop(tiny):
    """The full-attention layer (last of the default four) on its own: per head, the query half
    and gate half of attn_q, per-head norms, IMRoPE, a causal softmax, times sigmoid(gate)."""
    ref = HybridReferenceModel.from_gguf(tiny["qwen35"])
    il = ref.hybrid.recurrent.index(False)
    p, t, hd, n = f"blk.{il}.", ref.tensors, ref.head_dim, 9
    h = np.random.default_rng(9).standard_normal((n, ref.n_embd))
    pos = np.arange(n)
    got, _ = ref._gated_attention(h, p, pos, ref.empty_state().layers[il])
    wq, wk, wv = (t[p + f"attn_{x}.weight"].astype(np.float64) for x in "qkv")
    out = np.zeros((n, ref.n_head * hd))
    for head in range(ref.n_head):
        kv_head = head // (ref.n_head // ref.n_head_kv)
        qg = h @ wq[2 * hd * head:2 * hd * (head + 1)].T
        q, gate = qg[:, :hd], qg[:, hd:]
        k, v = h @ wk[hd * kv_head:hd * (kv_head + 1)].T, h @ wv[hd * kv_head:hd * (kv_head + 1)].T
        q = rope(rms_norm(q, t[p + "attn_q_norm.weight"], ref.rms_eps)[:, None], pos, n_rot=ref.n_rot,
                 base=ref.rope_base, neox=True)[:, 0]
        k = rope(rms_norm(k, t[p + "attn_k_norm.weight"], ref.rms_eps)[:, None], pos, n_rot=ref.n_rot,
                 base=ref.rope_base, neox=True)[:, 0]
        for i in range(n):
            s = q[i] @ k[:i + 1].T / math.sqrt(hd)
            w = np.exp(s - s.max())
            out[i, hd * head:hd * (head + 1)] = (w / w.sum()) @ v[:i + 1] / (1 + np.exp(-gate[i]))
    np.testing.assert_allclose(got, out @ t[p + "attn_output.weight"].astype(np.float64).T, atol=1e-10)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_decode_from_carried_state_equals_one_prefill(tiny, arch):
    ref = HybridReferenceModel.from_gguf(tiny[arch])
    assert isinstance(ref, HybridReferenceModel)
    ids = [int(i) for i in np.random.default_rng(10).integers(0, ref.n_vocab, 30)]
    whole = ref.forward(ids)
    rows, state = [], None
    for a, b in ((0, 13), (13, 14), (14, 20), *((i, i + 1) for i in range(20, 30))):
        logits, state = ref.forward(ids[a:b], past_kv=state, return_kv=True)
        rows.append(logits)
    np.testing.assert_allclose(np.concatenate(rows), whole, rtol=0, atol=1e-9)
    assert state.n_past == 30
    # the logits are not degenerate: a spread of whole units, more than one top token
    assert whole.max() - whole.min() > 5 and len(set(whole.argmax(-1))) > 5


def test_the_dense_reference_points_a_hybrid_to_its_own(tiny):
    with pytest.raises(ValueError, match="load it with hybrid_model.HybridReferenceModel.from_gguf"):
        ReferenceModel.from_gguf(tiny["qwen35"])


def test_forward_does_not_change_the_state_it_continues(tiny):
    ref = HybridReferenceModel.from_gguf(tiny["qwen35"])
    _, state = ref.forward([5, 6, 7], return_kv=True)
    snapshot = state.copy()
    a = ref.forward([8, 9], past_kv=state)
    b = ref.forward([8, 9], past_kv=state)
    np.testing.assert_array_equal(a, b)
    for x, y in zip(state.layers, snapshot.layers):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_tiny_writer_lays_out_the_real_files_tensors(tmp_path, arch):
    path = write_tiny_qwen35(tmp_path / f"{arch}.gguf", arch, nextn_layers=1, weight_type="q4_k")
    meta, infos, _ = read_gguf(path)
    ne = {i.name: list(i.ne) for i in infos}
    types = {i.name: i.qtype for i in infos}
    assert meta["general.architecture"] == arch and meta["tokenizer.ggml.pre"] == "qwen35"
    assert meta[f"{arch}.block_count"] == 5 and meta[f"{arch}.nextn_predict_layers"] == 1
    assert meta[f"{arch}.rope.dimension_sections"] == [3, 3, 2, 0]
    assert (f"{arch}.feed_forward_length" in meta) == (arch == "qwen35")
    n_embd, value_dim, channels = 256, 4 * 64, 2 * 2 * 64 + 4 * 64
    assert ne["blk.0.attn_qkv.weight"] == [n_embd, channels]
    assert ne["blk.0.attn_gate.weight"] == [n_embd, value_dim]
    assert ne["blk.0.ssm_conv1d.weight"] == [4, channels] and types["blk.0.ssm_conv1d.weight"] == QT.F32
    assert ne["blk.0.ssm_a"] == [4] and ne["blk.0.ssm_dt.bias"] == [4]
    assert ne["blk.0.ssm_beta.weight"] == ne["blk.0.ssm_alpha.weight"] == [n_embd, 4]
    assert ne["blk.0.ssm_norm.weight"] == [64] and ne["blk.0.ssm_out.weight"] == [value_dim, n_embd]
    assert ne["blk.3.attn_q.weight"] == [n_embd, 2 * 4 * 64] and "blk.3.attn_qkv.weight" not in ne
    assert "blk.4.nextn.eh_proj.weight" in ne   # the MTP block, after the trunk
    if arch == "qwen35moe":
        assert ne["blk.0.ffn_gate_inp_shexp.weight"] == [n_embd, 1]
        assert types["blk.0.ffn_gate_inp_shexp.weight"] == types["blk.0.ffn_gate_inp.weight"] == QT.F32
        assert ne["blk.0.ffn_down_shexp.weight"] == [256, n_embd]
    a = HybridReferenceModel.from_gguf(path)
    assert a.n_layer == 4 and a.hybrid.recurrent == (True, True, True, False)
    # the MTP block's tensors change nothing: the trunk's logits are those of a file without it
    b = HybridReferenceModel.from_gguf(write_tiny_qwen35(tmp_path / "plain.gguf", arch, weight_type="q4_k"))
    ids = [1, 50, 99, 7]
    np.testing.assert_array_equal(a.forward(ids), b.forward(ids))


def test_recurrent_layers_array_sets_the_layer_kinds(tmp_path):
    path = write_tiny_qwen35(tmp_path / "kinds.gguf", recurrent_layers=[True, False, True, True])
    ref = HybridReferenceModel.from_gguf(path)
    assert ref.hybrid.recurrent == (True, False, True, True)
    assert "blk.1.attn_q.weight" in ref.tensors and "blk.3.attn_qkv.weight" in ref.tensors
    shape = ref.hybrid
    per_layer = 3 * (2 * 2 * 64 + 4 * 64) + 4 * 64 * 64
    assert hybrid_state_bytes(shape) == 4 * 3 * per_layer
