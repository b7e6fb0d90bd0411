"""gpt-oss's pieces in the float64 reference and the tiny writer: MXFP4 blocks as GGML lays
them out (checked against gguf-py's independent decoder), YaRN's rotary embedding and gpt-oss's
clamped SwiGLU and routing. The engine's gpt-oss graph is not in yet; its tests join these."""
import math

import gguf
import numpy as np
import pytest

from pyllama_paged.testing.reference import numpy_model as ref
from pyllama_paged.testing.reference.tiny_gguf import dequantize_mxfp4, quantize_mxfp4


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
