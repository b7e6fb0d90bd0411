"""NumPy reference forward pass: the logits oracle for the engine (DESIGN.md §4).

``ReferenceModel.from_gguf(path)`` loads a GGUF of arch ``gemma3``, ``llama``,
``qwen2``, ``qwen3``, ``qwen3moe`` or ``gpt-oss`` (the real default Gemma 3 270M file included;
``qwen35`` and ``qwen35moe`` load with ``hybrid_model.HybridReferenceModel``), dequantizing
every tensor to float32 with ``gguf.quants.dequantize``; ``forward(token_ids)`` runs
the whole sequence from position 0 with full causal attention (no KV cache, no
batching) in float64 and returns logits ``[n_tokens, n_vocab]`` (float64).

The semantics are llama.cpp's, since the engine must agree with llama.cpp on the same
file.  Each choice is commented where it is made; in short:

* RMSNorm: ``x / sqrt(mean(x^2) + eps) * w``, weight used as stored.  For Gemma the
  "1 + w" of the HF implementation is already baked into the GGUF by llama.cpp's
  converter (the real 270M file's norm weights are e.g. 7..62 for attn_norm, 0.0 where
  HF's raw weight is -1), so no +1 here.
* RoPE: NEOX layout (rotate x[i] with x[i + n_rot/2]) for gemma3/qwen2/qwen3, NORMAL
  layout (rotate x[2i] with x[2i+1]) for llama - llama.cpp's rope type per arch; the
  llama converter permutes Q/K rows to match.  theta_i = pos * freq_scale *
  base^(-2i/n_rot) / freq_factor_i (``rope_freqs.weight`` if present).
  ``freq_scale = 1/rope.scaling.factor`` for linear scaling; YaRN (global layers) as GGML's
  rope with llama.cpp's defaults (ext_factor 1, beta_fast 32, beta_slow 1); other kinds are refused.
* GQA: query head h reads KV head ``h // (n_head / n_head_kv)`` (GGML broadcasting).
* QK-norm (gemma3, qwen3): per-head RMSNorm of Q and K (weight length head_dim)
  before RoPE.
* Biases (qwen2's attn_q/k/v.bias; any ``*.bias`` of the projections) are added.
* gemma3: embeddings * sqrt(n_embd); Q scaled by 1/sqrt(head_dim) (llama.cpp's
  ``f_attention_scale``; 1/sqrt(n_embd/n_head) only for the 62-layer 27B) - this equals
  HF's query_pre_attn_scalar=head_dim for every size but 27B; post_attention_norm on
  the attention output and post_ffw_norm on the FFN output, each before its residual
  add; FFN = down(gelu_tanh(gate(x)) * up(x)).
* gemma3 sliding window: enabled iff ``gemma3.attention.sliding_window`` exists; layer
  il is local ("SWA") iff ``il % 6 < 5`` (llama.cpp's ``set_swa_pattern(6)``: layers
  5, 11, 17 of the 270M are global), unless ``{arch}.attention.sliding_window_pattern``
  overrides it (uint: that period; bool array: True = local).  A local layer's query at
  position p sees keys at positions ``p - window < k_pos <= p`` (llama.cpp's
  ``p1 - p0 >= n_swa`` masks; same as HF's ``q - k < window``).  Local layers use RoPE
  base 10000 (or ``rope.freq_base_swa`` if present) with no scaling; global layers use
  ``rope.freq_base`` and the linear rope scaling factor if present (Gemma 3 4B+ have
  factor 8; the 270M has none).
* llama/qwen: FFN = down(silu(gate(x)) * up(x)); attention scale 1/sqrt(head_dim); no
  sliding window (llama.cpp ignores it for these archs too).
* qwen3moe: qwen3's attention; the FFN is routed experts (llama.cpp's build_moe_ffn with
  softmax gating and normalised weights): probs = softmax(ffn_gate_inp x) over
  ``expert_count`` experts, the ``expert_used_count`` most probable kept (the lower id
  first on a tie), their probs divided by their sum; the output is the so-weighted sum of
  those experts' down_e(silu(gate_e(x)) * up_e(x)), expert e being matrix e of the 3-D
  ``ffn_{gate,up,down}_exps`` tensors.  ``forward`` leaves in ``last_router_margin`` each
  token's smallest gap (over the layers, in router logits) between the last expert kept and
  the best one left out: an engine may route a token whose gap is within its rounding to the
  other expert, a near-tie as between two best tokens.
* gpt-oss (llama.cpp's openai-moe graph): NEOX rope with YaRN on every layer (the file's
  ``rope.scaling.factor`` and ``original_context_length``; beta 32/1, which llama.cpp keeps
  whatever the file says; cos/sin times ``rope.scaling.attn_factor`` if given); biases on
  q/k/v/o; a learned sink logit per head (``attn_sinks.weight``) in every softmax; layer il
  sliding-window iff ``il % 2 == 0`` (llama.cpp's ``set_swa_pattern(2)``; a
  ``sliding_window_pattern`` key overrides it as for gemma3), with the same rope as the full
  layers unless ``rope.freq_base_swa`` is given; attention scale 1/sqrt(n_rot); no norm on
  the attention output: ``post_attention_norm`` is the FFN's input norm (there is no
  ``ffn_norm``); the FFN is ``gpt_oss_experts``: router logits plus ``ffn_gate_inp.bias``,
  the top ``expert_used_count`` kept and softmaxed among themselves, each expert's gate/up/down
  with its own bias row (``ffn_*_exps.bias``), the clamped SwiGLU (``swiglu_oai``).  MXFP4
  expert weights are dequantized by gguf-py like every other type.
* Final logit soft-capping ``cap * tanh(logits / cap)`` iff
  ``{arch}.final_logit_softcapping`` is present and > 0 (Gemma 3 has none).
* Output head: ``output.weight`` if present, otherwise tied to ``token_embd.weight``.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import gguf

SUPPORTED_ARCHS = ("gemma3", "llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss")
# Qwen3.5/3.6's Gated DeltaNet hybrids: a model of their own (hybrid_model.HybridReferenceModel)
HYBRID_ARCHS = ("qwen35", "qwen35moe")

# llama.cpp's rope type per architecture.
ROPE_NEOX = {"gemma3": True, "qwen2": True, "qwen3": True, "qwen3moe": True, "gpt-oss": True, "llama": False}
# archs whose FFN is routed experts; their dense feed_forward_length is informational
EXPERT_ARCHS = ("qwen3moe", "gpt-oss")


# --------------------------------------------------------------------------- ops


def _sliding_layers(pattern, n_layer: int) -> list[bool]:
    """Which layers slide, from <arch>.attention.sliding_window_pattern: a per-layer list, or
    n (every n-th layer is full, the others slide; 0: all slide)."""
    if isinstance(pattern, (list, tuple)):
        return [bool(b) for b in pattern][:n_layer]
    n = int(pattern)
    return [n == 0 or (il % n) < (n - 1) for il in range(n_layer)]


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, then multiply by ``w`` as stored in the GGUF."""
    x = np.asarray(x, dtype=np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (ggml_gelu and HF's gelu_pytorch_tanh)."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def routed_experts(h: np.ndarray, router: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                   n_used: int, *, act=silu, router_input: np.ndarray | None = None,
                   expert_scale: np.ndarray | None = None) -> np.ndarray:
    """The routed experts' FFN of rows h [n, n_embd]: router [n_expert, n_embd], gate and up
    [n_expert, n_ff_exp, n_embd], down [n_expert, n_embd, n_ff_exp] (numpy shapes). The router
    reads router_input where given (gemma4's differs from the experts' input), else h; act is
    the gate's activation; expert_scale [n_expert] multiplies each expert's output (gemma4)."""
    probs = softmax((h if router_input is None else router_input) @ router.T.astype(np.float64))
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :n_used]   # [n, n_used]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    weights /= weights.sum(axis=-1, keepdims=True)
    out = np.zeros((h.shape[0], down.shape[1]), dtype=np.float64)
    for e in np.unique(chosen):
        rows, slot = np.nonzero(chosen == e)
        x = h[rows]
        y = (act(x @ gate[e].T.astype(np.float64)) * (x @ up[e].T.astype(np.float64))) @ down[e].T.astype(np.float64)
        out[rows] += weights[rows, slot][:, None] * (y if expert_scale is None else y * expert_scale[e])
    return out


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    """gpt-oss's clamped SwiGLU (GGML's swiglu_oai): gate clamped above, up clamped both ways."""
    x = np.minimum(gate, limit)
    y = np.clip(up, -limit, limit)
    return x / (1.0 + np.exp(-alpha * x)) * (y + 1.0)


def gpt_oss_experts(h: np.ndarray, router: np.ndarray, router_bias: np.ndarray, gate: np.ndarray,
                    gate_bias: np.ndarray, up: np.ndarray, up_bias: np.ndarray, down: np.ndarray,
                    down_bias: np.ndarray, n_used: int) -> np.ndarray:
    """gpt-oss's routed FFN of rows h [n, n_embd]: the top n_used router logits, softmaxed among
    themselves (llama.cpp's SOFTMAX_WEIGHT gating), weight experts with per-expert biases [n_expert, rows]."""
    logits = h @ router.T.astype(np.float64) + router_bias
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :n_used]
    weights = softmax(np.take_along_axis(logits, chosen, axis=-1))
    out = np.zeros((h.shape[0], down.shape[1]), dtype=np.float64)
    for e in np.unique(chosen):
        rows, slot = np.nonzero(chosen == e)
        x = h[rows]
        act = swiglu_oai(x @ gate[e].T.astype(np.float64) + gate_bias[e], x @ up[e].T.astype(np.float64) + up_bias[e])
        out[rows] += weights[rows, slot][:, None] * (act @ down[e].T.astype(np.float64) + down_bias[e])
    return out


def yarn_corr_dims(n_rot: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """YaRN's ramp ends (in rotated-pair dims): where a pair's wavelength spans beta_fast and
    beta_slow turns of the original context, floored/ceiled and clipped as GGML does."""
    def dim(n_turns: float) -> float:
        return n_rot * math.log(n_ctx_orig / (n_turns * 2 * math.pi)) / (2 * math.log(base))
    return max(0.0, math.floor(dim(beta_fast))), min(n_rot - 1.0, math.ceil(dim(beta_slow)))


def router_margin(h: np.ndarray, router: np.ndarray, n_used: int, bias: np.ndarray | None = None) -> np.ndarray:
    """Per row of h, how far (in router logits, plus ``bias`` if the router has one) the last
    expert kept is above the best one left out: where this is small, an engine's rounding may
    route the token to the other expert."""
    logits = h @ router.T.astype(np.float64)
    if bias is not None:
        logits = logits + bias
    logits = np.sort(logits, axis=-1)[:, ::-1]
    if n_used >= logits.shape[1]:
        return np.full(h.shape[0], np.inf)
    return logits[:, n_used - 1] - logits[:, n_used]


def rope(
    x: np.ndarray,
    positions: Sequence[int] | np.ndarray,
    *,
    n_rot: int,
    base: float,
    freq_scale: float = 1.0,
    neox: bool,
    freq_factors: np.ndarray | None = None,
    ext_factor: float = 0.0,
    attn_factor: float = 1.0,
    corr_dims: tuple[float, float] = (0.0, 0.0),
) -> np.ndarray:
    """Rotary embedding of ``x`` [n_tokens, n_heads, head_dim] at ``positions``.

    Only the first ``n_rot`` dims rotate.  NEOX pairs (i, i + n_rot/2), NORMAL pairs
    (2i, 2i+1); the angle of pair i is ``pos * freq_scale * base^(-2i/n_rot) / ff_i``.
    With ``ext_factor`` (YaRN), pair i's angle blends the interpolated and the original one by
    a ramp over ``corr_dims`` and cos/sin are scaled by ``attn_factor * (1 + 0.1 ln(1/freq_scale))``.
    """
    x = np.array(x, dtype=np.float64, copy=True)
    pos = np.asarray(positions, dtype=np.float64)
    half = n_rot // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)[:half]
    theta_extrap = pos[:, None] * inv_freq[None, :]  # [n_tokens, half]
    theta = freq_scale * theta_extrap
    mscale = attn_factor
    if ext_factor != 0.0:
        low, high = corr_dims
        # GGML's ramp: 1 below low (extrapolate), 0 above high (interpolate), indexed by pair
        ramp = 1.0 - np.clip((np.arange(half, dtype=np.float64) - low) / max(0.001, high - low), 0.0, 1.0)
        mix = ramp * ext_factor
        theta = theta * (1.0 - mix) + theta_extrap * mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    cos = (np.cos(theta) * mscale)[:, None, :]
    sin = (np.sin(theta) * mscale)[:, None, :]
    if neox:
        a = x[..., :half].copy()
        b = x[..., half:n_rot].copy()
        x[..., :half] = a * cos - b * sin
        x[..., half:n_rot] = a * sin + b * cos
    else:
        a = x[..., 0:n_rot:2].copy()
        b = x[..., 1:n_rot:2].copy()
        x[..., 0:n_rot:2] = a * cos - b * sin
        x[..., 1:n_rot:2] = a * sin + b * cos
    return x


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    scale: float,
    q_pos: Sequence[int] | np.ndarray | None = None,
    k_pos: Sequence[int] | np.ndarray | None = None,
    window: int | None = None,
    causal: bool = True,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Plain softmax(scale * Q K^T + mask) V with GQA and an optional sliding window.

    ``sinks`` [n_head] (gpt-oss): each head's softmax gets one more logit, of a key whose
    value is 0, so it only grows the denominator.

    q [n_q, n_head, d], k [n_k, n_head_kv, d], v [n_k, n_head_kv, d_v] -> [n_q, n_head, d_v].
    Positions default to 0..n-1 for keys and the last n_q key positions for queries.
    Key j is visible to query i iff ``k_pos[j] <= q_pos[i]`` (when causal) and
    ``q_pos[i] - k_pos[j] < window`` (when a window is given).  A query that sees no
    key at all gets zeros.  Also usable directly as the paged-kernel oracle on
    gathered K/V.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    n_q, n_head, _ = q.shape
    n_k, n_head_kv, _ = k.shape
    if n_head % n_head_kv:
        raise ValueError("n_head must be a multiple of n_head_kv")
    group = n_head // n_head_kv
    kp = np.arange(n_k) if k_pos is None else np.asarray(k_pos)
    qp = (kp[-n_q:] if n_q <= n_k else np.arange(n_q)) if q_pos is None else np.asarray(q_pos)
    kh = np.repeat(k, group, axis=1)  # query head h -> kv head h // group
    vh = np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kh) * scale
    allowed = np.ones((n_q, n_k), dtype=bool)
    if causal:
        allowed &= kp[None, :] <= qp[:, None]
    if window is not None:
        allowed &= (qp[:, None] - kp[None, :]) < window
    s = np.where(allowed[None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    sink = None if sinks is None else np.asarray(sinks, dtype=np.float64)[:, None, None]
    if sink is not None:
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + np.exp(sink - m)
    p = np.divide(p, denom, out=np.zeros_like(p), where=denom > 0)
    return np.einsum("hqk,khd->qhd", p, vh)


# --------------------------------------------------------------------------- GGUF

# gguf.GGUFReader builds Python objects for every element of every array field, which
# takes tens of seconds on a 262k-token vocabulary; this small reader parses the same
# container format (v2/v3, little-endian) directly.  The self-check compares it with
# GGUFReader on the tiny models.  Dequantization itself is gguf.quants.dequantize.

_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}


@dataclass
class GGUFTensorInfo:
    name: str
    ne: tuple[int, ...]  # GGML order: ne[0] is the row length
    qtype: gguf.GGMLQuantizationType
    offset: int  # absolute byte offset in the file

    @property
    def np_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], list[GGUFTensorInfo], np.memmap]:
    """Parse a GGUF file: (metadata dict, tensor infos, read-only memmap of the file)."""
    mm = np.memmap(os.fspath(path), dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    pos = 0

    def unpack(fmt: str):
        nonlocal pos
        v = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def read_str() -> str:
        nonlocal pos
        n = unpack("<Q")
        s = bytes(buf[pos:pos + n]).decode("utf-8", errors="replace")
        pos += n
        return s

    def read_value(vtype: int):
        nonlocal pos
        if vtype == 8:
            return read_str()
        if vtype == 9:
            etype = unpack("<I")
            count = unpack("<Q")
            if etype == 8:
                return [read_str() for _ in range(count)]
            if etype == 9:
                return [read_value(9) for _ in range(count)]
            dt = np.dtype(_SCALAR_NP[etype])
            arr = np.frombuffer(buf, dtype=dt, count=count, offset=pos).copy()
            pos += dt.itemsize * count
            return [bool(b) for b in arr] if etype == 7 else arr.tolist()
        return unpack(_SCALAR_FMT[vtype])

    if bytes(buf[0:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 4
    version = unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    n_tensors = unpack("<Q")
    n_kv = unpack("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = read_str()
        meta[key] = read_value(unpack("<I"))
    raw_infos = []
    for _ in range(n_tensors):
        name = read_str()
        n_dims = unpack("<I")
        ne = tuple(unpack("<Q") for _ in range(n_dims))
        qtype = gguf.GGMLQuantizationType(unpack("<I"))
        raw_infos.append((name, ne, qtype, unpack("<Q")))
    align = int(meta.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    infos = [GGUFTensorInfo(n, ne, qt, data_start + off) for n, ne, qt, off in raw_infos]
    return meta, infos, mm


def arch_fields(meta: dict[str, Any], arch: str):
    """hp(key, default): the value of "<arch>.<key>" in meta, else default (KeyError when none is given)."""
    def hp(key: str, default: Any = KeyError) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is KeyError:
            raise KeyError(f"GGUF is missing {full}")
        return default
    return hp


def load_tensor(mm: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    """Dequantize one tensor to float32 with gguf.quants.dequantize (numpy shape)."""
    block, type_size = gguf.GGML_QUANT_SIZES[info.qtype]
    n_el = int(np.prod(info.ne)) if info.ne else 1
    n_bytes = n_el // block * type_size
    raw = mm[info.offset:info.offset + n_bytes]
    shape = info.np_shape
    if info.qtype == gguf.GGMLQuantizationType.F32:
        arr = raw.view(np.float32)
    elif info.qtype == gguf.GGMLQuantizationType.F16:
        arr = raw.view(np.float16).astype(np.float32)
    else:
        row_bytes = info.ne[0] // block * type_size
        arr = gguf.quants.dequantize(raw.reshape(-1, row_bytes), info.qtype)
    return np.array(arr, dtype=np.float32).reshape(shape)


# --------------------------------------------------------------------------- model


@dataclass
class LayerInfo:
    sliding: bool  # local (sliding-window) attention layer
    rope_base: float
    rope_freq_scale: float
    # YaRN (rope.scaling.type "yarn"): the ramp's blend, the cos/sin scale before YaRN's own
    # magnitude factor, and the ramp's ends; the defaults are plain RoPE
    yarn_ext_factor: float = 0.0
    yarn_attn_factor: float = 1.0
    yarn_corr_dims: tuple[float, float] = (0.0, 0.0)


@dataclass
class ReferenceModel:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key_length
    head_dim_v: int  # value_length
    n_ff: int
    n_vocab: int
    n_rot: int
    rms_eps: float
    context_length: int
    sliding_window: int | None
    attn_scale: float
    final_logit_softcap: float | None
    layers: list[LayerInfo]
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]
    tokens: list[str] = field(default_factory=list)
    n_expert: int = 0        # routed experts per layer (qwen3moe, gpt-oss); 0: a dense FFN
    n_expert_used: int = 0   # experts each token runs
    bos_id: int | None = None
    eos_id: int | None = None
    _piece_to_id: dict[str, int] | None = field(default=None, repr=False)
    _head64: tuple | None = field(default=None, repr=False)   # (head, its float64 copy)

    # ----------------------------------------------------------------- loading

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "ReferenceModel":
        meta, infos, mm = read_gguf(path)
        arch = meta["general.architecture"]
        if arch in HYBRID_ARCHS:
            raise ValueError(f"{arch!r} is a Gated DeltaNet hybrid: load it with "
                             "hybrid_model.HybridReferenceModel.from_gguf")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {arch!r}")
        hp = arch_fields(meta, arch)
        tensors = {info.name: load_tensor(mm, info) for info in infos}
        del mm

        n_embd = int(hp("embedding_length"))
        n_head = int(hp("attention.head_count"))
        n_head_kv = int(hp("attention.head_count_kv", n_head))
        n_layer = int(hp("block_count"))
        # llama.cpp: n_embd_head_k = key_length if present else n_embd / n_head.
        head_dim = int(hp("attention.key_length", n_embd // n_head))
        head_dim_v = int(hp("attention.value_length", n_embd // n_head))
        n_rot = int(hp("rope.dimension_count", head_dim))
        n_vocab = tensors["token_embd.weight"].shape[0]

        freq_base = float(hp("rope.freq_base", 10000.0))
        freq_scale = 1.0
        scaling_type = hp("rope.scaling.type", None)
        factor = hp("rope.scaling.factor", None)
        if scaling_type not in (None, "none", "linear", "yarn"):
            raise NotImplementedError(f"rope scaling {scaling_type!r} not modelled by the reference")
        if factor is not None and float(factor) not in (0.0, 1.0) and scaling_type != "none":
            freq_scale = 1.0 / float(factor)
        yarn: dict[str, Any] = {}
        if scaling_type == "yarn" and freq_scale != 1.0:
            # llama.cpp's defaults (ext_factor 1, beta 32/1, the original context from the GGUF);
            # its attn_factor cancels GGML's own 1 + 0.1 ln(factor) only when a log multiplier
            # is given, which no supported architecture writes, so it stays 1
            n_ctx_orig = int(hp("rope.scaling.original_context_length", hp("context_length", 0)))
            # rope.scaling.attn_factor (llama.cpp's rope_attn_factor) multiplies cos/sin on top
            yarn = dict(yarn_ext_factor=1.0, yarn_attn_factor=float(hp("rope.scaling.attn_factor", 1.0)),
                        yarn_corr_dims=yarn_corr_dims(n_rot, n_ctx_orig, freq_base, 32.0, 1.0))

        sliding_window = None
        swa_flags = [False] * n_layer
        swa_base, swa_scale = freq_base, freq_scale
        if arch == "gemma3":
            sw = hp("attention.sliding_window", None)
            if sw is not None and int(sw) > 0:
                sliding_window = int(sw)
                swa_flags = _sliding_layers(hp("attention.sliding_window_pattern", 6), n_layer)
                # llama.cpp hard-codes the local layers' rope for gemma3: base 10000,
                # no scaling (HF's rope_local_base_freq); a freq_base_swa key wins.
                swa_base = float(hp("rope.freq_base_swa", 10000.0))
                swa_scale = 1.0
        swa_yarn: dict[str, Any] = {}
        if arch == "gpt-oss":
            # llama.cpp: the window is required; even layers slide (a pattern of 2), and they
            # keep the full layers' rope, YaRN included, unless freq_base_swa says otherwise
            sliding_window = int(hp("attention.sliding_window"))
            swa_flags = _sliding_layers(hp("attention.sliding_window_pattern", 2), n_layer)
            swa_base = float(hp("rope.freq_base_swa", freq_base))
            swa_yarn = yarn
        layers = [
            LayerInfo(True, swa_base, swa_scale, **swa_yarn) if swa_flags[il]
            else LayerInfo(False, freq_base, freq_scale, **yarn)
            for il in range(n_layer)
        ]

        if arch == "gemma3" and n_layer == 62:
            attn_scale = 1.0 / math.sqrt(n_embd / n_head)  # 27B: query_pre_attn_scalar = n_embd/n_head
        elif arch == "gpt-oss":
            attn_scale = 1.0 / math.sqrt(n_rot)   # llama.cpp's openai-moe graph scales by the rotated dims
        else:
            attn_scale = 1.0 / math.sqrt(head_dim)

        softcap = hp("final_logit_softcapping", None)
        softcap = float(softcap) if softcap is not None and float(softcap) > 0 else None

        return cls(
            arch=arch, tensors=tensors, metadata=meta,
            # the shapes
            # (an expert model's dense feed_forward_length is informational)
            n_layer=n_layer, n_embd=n_embd, n_vocab=n_vocab,
            n_ff=int(hp("feed_forward_length", 0 if arch in EXPERT_ARCHS else KeyError)),
            n_expert=int(hp("expert_count", 0)), n_expert_used=int(hp("expert_used_count", 0)),
            n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, head_dim_v=head_dim_v, n_rot=n_rot,
            # attention and normalization
            rms_eps=float(hp("attention.layer_norm_rms_epsilon")), context_length=int(hp("context_length", 0)),
            sliding_window=sliding_window, attn_scale=attn_scale, final_logit_softcap=softcap, layers=layers,
            # the vocabulary
            tokens=list(meta.get("tokenizer.ggml.tokens", [])), bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        )

    # ----------------------------------------------------------------- helpers

    def token_id(self, piece: str) -> int:
        """Exact vocabulary lookup of a piece (e.g. "▁Paris")."""
        if self._piece_to_id is None:
            self._piece_to_id = {}
            for i, t in enumerate(self.tokens):
                self._piece_to_id.setdefault(t, i)
        return self._piece_to_id[piece]

    def _w(self, name: str) -> np.ndarray | None:
        return self.tensors.get(name)

    # Heads up to this many weights are multiplied in float64 (a tiny model's head is a
    # few MB): float32 GEMM results depend on the BLAS kernel and the matrix shape
    # (OPENBLAS_CORETYPE, thread count), so only float64 makes the reference the same
    # for a prompt run whole or in pieces.
    FLOAT64_HEAD_MAX = 1 << 24

    def _head(self, x: np.ndarray, w_out: np.ndarray) -> np.ndarray:
        """Logits of the final states. A real model's head (262k x 640) stays float32:
        upcasting it per call would dominate the run time, and its accumulation error
        (~1e-6 relative, shape-dependent) is far below any engine tolerance."""
        if w_out.size > self.FLOAT64_HEAD_MAX:
            return (x.astype(np.float32) @ w_out.T).astype(np.float64)
        if self._head64 is None or self._head64[0] is not w_out:
            self._head64 = (w_out, w_out.astype(np.float64))
        return x @ self._head64[1].T

    def _linear(self, x: np.ndarray, prefix: str) -> np.ndarray:
        y = x @ self.tensors[prefix + ".weight"].T.astype(np.float64)
        b = self.tensors.get(prefix + ".bias")
        return y if b is None else y + b

    # ----------------------------------------------------------------- forward

    def forward(
        self,
        token_ids: Sequence[int],
        *,
        past_kv: list[tuple[np.ndarray, np.ndarray]] | None = None,
        return_kv: bool = False,
        embeds: dict[int, np.ndarray] | None = None,
    ):
        """Logits [n_tokens, n_vocab] (float64) for ``token_ids`` at positions 0..n-1.

        With ``return_kv=True`` returns ``(logits, kv)`` where ``kv[il] = (K, V)`` are
        the layer's cached keys after QK-norm and RoPE, ``[n_tokens, n_head_kv,
        head_dim]``, and values ``[n_tokens, n_head_kv, head_dim_v]`` - what a KV cache
        must hold.  Passing such a ``kv`` back as ``past_kv`` continues the sequence:
        the new tokens take positions ``n_past..`` and attend to the past keys too
        (the result equals one full forward; used for cheap greedy decoding and as the
        oracle for chunked prefill).  The returned ``kv`` then covers past + new.
        ``embeds`` maps positions (absolute, n_past..) to input rows [n_embd] that replace those
        tokens' embeddings, unscaled (an image's rows, as llama.cpp feeds them to Gemma 3).
        """
        ids = np.asarray(list(token_ids), dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError("token_ids must be a non-empty 1-D sequence")
        if ids.min() < 0 or ids.max() >= self.n_vocab:
            raise ValueError("token id out of range")
        n = len(ids)
        n_past = 0 if not past_kv else past_kv[0][0].shape[0]
        pos = np.arange(n_past, n_past + n)
        eps = self.rms_eps
        gemma = self.arch == "gemma3"
        gpt_oss = self.arch == "gpt-oss"
        neox = ROPE_NEOX[self.arch]
        freq_factors = self._w("rope_freqs.weight")

        x = self.tensors["token_embd.weight"][ids].astype(np.float64)
        # per new token, its smallest router_margin over the layers (inf: no experts)
        self.last_router_margin = np.full(n, np.inf)
        if gemma:
            x = x * math.sqrt(self.n_embd)  # Gemma's embedding normalizer
        for p_abs, row in (embeds or {}).items():
            if n_past <= p_abs < n_past + n:
                x[p_abs - n_past] = np.asarray(row, dtype=np.float64)
        kv_out = []
        for il, info in enumerate(self.layers):
            p = f"blk.{il}."
            h = rms_norm(x, self.tensors[p + "attn_norm.weight"], eps)
            q = self._linear(h, p + "attn_q").reshape(n, self.n_head, self.head_dim)
            k = self._linear(h, p + "attn_k").reshape(n, self.n_head_kv, self.head_dim)
            v = self._linear(h, p + "attn_v").reshape(n, self.n_head_kv, self.head_dim_v)
            qn, kn = self._w(p + "attn_q_norm.weight"), self._w(p + "attn_k_norm.weight")
            if qn is not None:
                q = rms_norm(q, qn, eps)
            if kn is not None:
                k = rms_norm(k, kn, eps)
            q = rope(q, pos, n_rot=self.n_rot, base=info.rope_base, freq_scale=info.rope_freq_scale,
                     neox=neox, freq_factors=freq_factors, ext_factor=info.yarn_ext_factor,
                     attn_factor=info.yarn_attn_factor, corr_dims=info.yarn_corr_dims)
            k = rope(k, pos, n_rot=self.n_rot, base=info.rope_base, freq_scale=info.rope_freq_scale,
                     neox=neox, freq_factors=freq_factors, ext_factor=info.yarn_ext_factor,
                     attn_factor=info.yarn_attn_factor, corr_dims=info.yarn_corr_dims)
            if past_kv:
                k = np.concatenate([past_kv[il][0], k], axis=0)
                v = np.concatenate([past_kv[il][1], v], axis=0)
            if return_kv:
                kv_out.append((k, v))
            window = self.sliding_window if info.sliding else None
            a = attention(q, k, v, scale=self.attn_scale, q_pos=pos, k_pos=np.arange(n_past + n), window=window,
                          sinks=self._w(p + "attn_sinks.weight"))
            o = self._linear(a.reshape(n, self.n_head * self.head_dim_v), p + "attn_output")
            pan = self._w(p + "post_attention_norm.weight")
            if pan is not None and not gpt_oss:
                o = rms_norm(o, pan, eps)
            x = x + o

            # gpt-oss's post_attention_norm is its FFN's input norm (llama.cpp's attn_post_norm)
            h = rms_norm(x, pan if gpt_oss else self.tensors[p + "ffn_norm.weight"], eps)
            if gpt_oss:
                router, router_bias = self.tensors[p + "ffn_gate_inp.weight"], self.tensors[p + "ffn_gate_inp.bias"]
                f = gpt_oss_experts(
                    h, router, router_bias,
                    self.tensors[p + "ffn_gate_exps.weight"], self.tensors[p + "ffn_gate_exps.bias"],
                    self.tensors[p + "ffn_up_exps.weight"], self.tensors[p + "ffn_up_exps.bias"],
                    self.tensors[p + "ffn_down_exps.weight"], self.tensors[p + "ffn_down_exps.bias"],
                    self.n_expert_used)
                self.last_router_margin = np.minimum(self.last_router_margin,
                                                     router_margin(h, router, self.n_expert_used, router_bias))
            elif self.n_expert:
                router = self.tensors[p + "ffn_gate_inp.weight"]
                f = routed_experts(h, router, self.tensors[p + "ffn_gate_exps.weight"],
                                   self.tensors[p + "ffn_up_exps.weight"], self.tensors[p + "ffn_down_exps.weight"],
                                   self.n_expert_used)
                self.last_router_margin = np.minimum(self.last_router_margin,
                                                     router_margin(h, router, self.n_expert_used))
            else:
                g = self._linear(h, p + "ffn_gate")
                u = self._linear(h, p + "ffn_up")
                act = gelu_tanh(g) if gemma else silu(g)
                f = self._linear(act * u, p + "ffn_down")
            pfn = self._w(p + "post_ffw_norm.weight")
            if pfn is not None:
                f = rms_norm(f, pfn, eps)
            x = x + f

        x = rms_norm(x, self.tensors["output_norm.weight"], eps)
        self.last_hidden = x   # the final normed states (what embeddings pool), float64
        w_out = self.tensors.get("output.weight")
        if w_out is None:
            w_out = self.tensors["token_embd.weight"]  # tied embeddings
        logits = self._head(x, w_out)
        if self.final_logit_softcap is not None:
            c = self.final_logit_softcap
            logits = c * np.tanh(logits / c)
        return (logits, kv_out) if return_kv else logits

    def generate_greedy(self, token_ids: Sequence[int], n_new: int) -> list[int]:
        """Greedy continuation (argmax; the lowest id wins ties) of ``token_ids``."""
        out: list[int] = []
        logits, kv = self.forward(token_ids, return_kv=True)
        for i in range(n_new):
            nxt = int(np.argmax(logits[-1]))
            out.append(nxt)
            if i + 1 < n_new:
                logits, kv = self.forward([nxt], past_kv=kv, return_kv=True)
        return out
