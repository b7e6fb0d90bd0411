"""Gated DeltaNet in float64: the pieces of Qwen3.5/3.6's linear-attention layers (GGUF
architectures ``qwen35`` and ``qwen35moe``) as llama.cpp computes them on a GGUF file, and
the multi-section rotary embedding of their full-attention layers.

Conventions (GGUF's, after llama.cpp's converter):

* The recurrent state of one value head is a matrix ``S[i, j]`` over key dimension ``i`` and
  value dimension ``j`` (``[H_v, S_k, S_v]`` for a layer). GGML stores it transposed, a row
  per value dimension (``[S_v, S_v, H_v]`` with the key index fastest); the pool in the engine
  holds GGML's layout, ``state_to_ggml`` converts.
* One step of the gated delta rule, per value head: ``S = exp(g) S``, then the state's
  prediction of the value ``S^T k`` is corrected towards ``v`` by ``beta``:
  ``S += k (beta (v - S^T k))^T``, and the output is ``S^T q / sqrt(S_k)``. ``g`` is the
  log-decay ``softplus(alpha + dt_bias) * ssm_a`` (the converter stores ``ssm_a`` as
  ``-exp(A_log)``, so ``g < 0``) and ``beta`` a sigmoid.
* Value head ``h`` reads query/key head ``h % H_k``: GGML's tiled broadcast. Hugging Face's
  model repeats each key head over consecutive value heads; llama.cpp's converter reorders the
  value heads (and every tensor indexed by them) so that the tiled order is the same model.
* The short convolution runs per channel over the last ``d_conv`` inputs: its state is the
  ``d_conv - 1`` inputs before the current ones (zeros at a sequence's start).
* q and k are L2-normalised as llama.cpp does: ``x / sqrt(sum(x^2) + eps)``, eps the model's
  RMS-norm epsilon.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def l2_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (llama.cpp's L2 norm of q and k)."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x)."""
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x))."""
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)), without overflow for large x."""
    return np.logaddexp(0.0, x)


def causal_conv(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The depthwise causal convolution of inputs x [n, channels] with weight [channels, d_conv]
    (numpy's view of ssm_conv1d.weight, GGML ne [d_conv, channels]), continuing from state
    [d_conv - 1, channels] (the inputs before x, oldest first). Output t is
    sum_k ext[t + k] * weight[:, k] over ext = state then x; returns (output [n, channels],
    the new state: ext's last d_conv - 1 rows)."""
    x = np.asarray(x, dtype=np.float64)
    d_conv = weight.shape[1]
    if state.shape != (d_conv - 1, x.shape[1]):
        raise ValueError(f"conv state of shape {state.shape}, expected {(d_conv - 1, x.shape[1])}")
    ext = np.concatenate([np.asarray(state, dtype=np.float64), x], axis=0)
    n = x.shape[0]
    w = np.asarray(weight, dtype=np.float64)
    out = np.zeros_like(x)
    for k in range(d_conv):
        out += ext[k:k + n] * w[:, k]
    return out, ext[n:].copy()


def _per_value_head(q: np.ndarray, k: np.ndarray, n_v_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """q and k [n, H_k, S_k] repeated to [n, H_v, S_k], value head h reading head h % H_k."""
    n_k_heads = q.shape[1]
    if n_v_heads % n_k_heads:
        raise ValueError(f"{n_v_heads} value heads are not a multiple of {n_k_heads} key heads")
    heads = np.arange(n_v_heads) % n_k_heads
    return q[:, heads], k[:, heads]


def delta_rule_recurrent(q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token. q, k [n, H_k, S_k] (L2-normalised); v [n, H_v, S_v];
    g (log-decay) and beta [n, H_v]; state [H_v, S_k, S_v]. Returns (output [n, H_v, S_v], the
    state after the last token)."""
    q, k, v, g, beta = (np.asarray(a, dtype=np.float64) for a in (q, k, v, g, beta))
    qh, kh = _per_value_head(q, k, v.shape[1])
    s = np.array(state, dtype=np.float64, copy=True)
    scale = 1.0 / np.sqrt(q.shape[2])
    out = np.empty_like(v)
    for t in range(v.shape[0]):
        s *= np.exp(g[t])[:, None, None]
        predicted = np.einsum("hij,hi->hj", s, kh[t])
        delta = (v[t] - predicted) * beta[t][:, None]
        s += np.einsum("hi,hj->hij", kh[t], delta)
        out[t] = np.einsum("hij,hi->hj", s, qh[t]) * scale
    return out, s


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """The same map as delta_rule_recurrent, computed a chunk of tokens at a time in matrix form.

    Within a chunk, with G the running sum of g and decay[t, s] = exp(G_t - G_s), the state after
    token t is exp(G_t) S0 + sum_{s <= t} decay[t, s] k_s u_s^T, where the corrected values u
    solve the unit lower-triangular system
        u_s + beta_s sum_{r < s} decay[s, r] (k_s . k_r) u_r = beta_s (v_s - exp(G_s) S0^T k_s),
    and output t is (exp(G_t) S0^T q_t + sum_{s <= t} decay[t, s] (q_t . k_s) u_s) / sqrt(S_k)."""
    q, k, v, g, beta = (np.asarray(a, dtype=np.float64) for a in (q, k, v, g, beta))
    qh, kh = _per_value_head(q, k, v.shape[1])
    s = np.array(state, dtype=np.float64, copy=True)
    scale = 1.0 / np.sqrt(q.shape[2])
    out = np.empty_like(v)
    for c0 in range(0, v.shape[0], chunk):
        c1 = min(v.shape[0], c0 + chunk)
        for h in range(v.shape[1]):
            out[c0:c1, h], s[h] = _chunk(qh[c0:c1, h], kh[c0:c1, h], v[c0:c1, h], g[c0:c1, h], beta[c0:c1, h],
                                         s[h], scale)
    return out, s


def _chunk(q, k, v, g, beta, s0, scale) -> tuple[np.ndarray, np.ndarray]:
    """One head's chunk of delta_rule_chunked: (outputs [C, S_v], state after it [S_k, S_v])."""
    n = len(g)
    cum = np.cumsum(g)
    decay = np.tril(np.exp(cum[:, None] - cum[None, :]))
    a = np.tril(beta[:, None] * decay * (k @ k.T), -1)
    rhs = beta[:, None] * (v - np.exp(cum)[:, None] * (k @ s0))
    u = np.linalg.solve(np.eye(n) + a, rhs)
    o = (np.exp(cum)[:, None] * (q @ s0) + (decay * (q @ k.T)) @ u) * scale
    s1 = np.exp(cum[-1]) * s0 + (k * np.exp(cum[-1] - cum)[:, None]).T @ u
    return o, s1


def state_to_ggml(state: np.ndarray) -> np.ndarray:
    """A layer's state [H_v, S_k, S_v] in GGML's layout: [H_v, S_v, S_k] in numpy order (a row
    per value dimension, the key index fastest), flattened."""
    return np.ascontiguousarray(np.swapaxes(state, 1, 2)).reshape(-1)


def imrope(x: np.ndarray, positions: Sequence[int] | np.ndarray, *, n_rot: int, sections: Sequence[int],
           base: float, freq_scale: float = 1.0) -> np.ndarray:
    """GGML's interleaved multi-section RoPE (GGML_ROPE_TYPE_IMROPE) of x [n, n_heads, head_dim]
    for text tokens, whose four position components are (pos, pos, pos, 0), as llama.cpp sets
    them. Rotary pair i (NEOX layout: dims i and i + n_rot / 2) takes sector i % sum(sections);
    sectors 0, 3, 6, ... below 3 sections[0] read the temporal position, 1, 4, ... below
    3 sections[1] the height, 2, 5, ... below 3 sections[2] the width, any other the fourth
    component; the angle is that position times freq_scale base^(-2i / n_rot)."""
    x = np.array(x, dtype=np.float64, copy=True)
    pos = np.asarray(positions, dtype=np.float64)
    half = n_rot // 2
    total = sum(sections)
    comp = np.empty(half, dtype=np.int64)   # which position component each pair reads (0..3)
    for i in range(half):
        sector = i % total
        if sector % 3 == 1 and sector < 3 * sections[1]:
            comp[i] = 1
        elif sector % 3 == 2 and sector < 3 * sections[2]:
            comp[i] = 2
        elif sector % 3 == 0 and sector < 3 * sections[0]:
            comp[i] = 0
        else:
            comp[i] = 3
    component_pos = np.stack([pos, pos, pos, np.zeros_like(pos)], axis=1)   # [n, 4]
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)
    theta = freq_scale * component_pos[:, comp] * inv_freq[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a = x[..., :half].copy()
    b = x[..., half:n_rot].copy()
    x[..., :half] = a * cos - b * sin
    x[..., half:n_rot] = a * sin + b * cos
    return x
