"""Write tiny GGUF models with random weights, laid out like llama.cpp's own files.

``write_tiny_model(path, arch, ...)`` produces a real GGUF (version 3) for one of the
architectures the engine supports (``gemma3``, ``llama``, ``qwen2``, ``qwen3``, ``qwen3moe``): the
tensor names, GGML shapes and metadata keys are the ones llama.cpp's converter emits
(mirrored from the real default ``gemma-3-270m`` file for gemma3), so the same loader
code path serves tiny test models and real ones.  Weights are random (seeded), scaled
so activations stay O(1) and logits are not degenerate.

Weight types: ``f32 f16 bf16 q8_0 q4_0 q5_0 q4_k q5_k q6_k``.  Norm weights and biases
always stay F32 (as in llama.cpp).  A 2-D weight whose row length (GGML ``ne0``, the
input dimension) is not a multiple of the type's block size falls back
(``q4_k/q5_k/q6_k -> q8_0 -> f16``), exactly like ``llama-quantize`` falls back for odd
rows, unless ``strict=True``.  ``type_overrides`` maps tensor names (fnmatch patterns,
e.g. ``"blk.*.ffn_down.weight"``) to a type, to build Q4_K_M-style mixes.

gguf-py 0.19 can quantize Q8_0/Q4_0/Q5_0/BF16 but not the K-quants, so Q4_K, Q5_K
and Q6_K blocks are packed here (a simple, non-optimal scale search: the format is what
matters; the oracle always dequantizes with ``gguf.quants.dequantize``).
"""

from __future__ import annotations

import fnmatch
import os
from typing import Callable, Mapping, Sequence

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

from ..vocab_metadata import add_tokenizer

SUPPORTED_ARCHS = ("gemma3", "llama", "qwen2", "qwen3", "qwen3moe")
EXPERT_ARCHS = ("qwen3moe",)   # routed experts (3-D ffn_*_exps tensors) instead of the dense FFN

WEIGHT_TYPES: dict[str, QT] = {
    "f32": QT.F32,
    "f16": QT.F16,
    "bf16": QT.BF16,
    "q8_0": QT.Q8_0,
    "q4_0": QT.Q4_0,
    "q5_0": QT.Q5_0,
    "q4_k": QT.Q4_K,
    "q5_k": QT.Q5_K,
    "q6_k": QT.Q6_K,
    # types our panel GEMMs do not take (GGML's own kernels run them)
    "q4_1": QT.Q4_1,
    "q5_1": QT.Q5_1,
    "iq4_nl": QT.IQ4_NL,
    "tq2_0": QT.TQ2_0,
}

# What llama-quantize does with rows that are not a multiple of the block size.
_FALLBACK = {"q4_k": "q8_0", "q5_k": "q8_0", "q6_k": "q8_0", "q8_0": "f16", "q4_0": "f16", "q5_0": "f16",
             "q4_1": "f16", "q5_1": "f16", "iq4_nl": "q8_0", "tq2_0": "q8_0"}

QK_K = 256

# general.file_type ("mostly X"); informational only, as in llama.cpp.
_FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q5_k": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "iq4_nl": gguf.LlamaFileType.MOSTLY_IQ4_NL,
    "tq2_0": gguf.LlamaFileType.MOSTLY_TQ2_0,
}


# --------------------------------------------------------------------------- K-quants


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _quantize_k_with_mins(rows: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits=4) or Q5_K (bits=5) blocks of float rows (row length % 256 == 0).

    Block: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of
    32, [Q5_K: 32 bytes qh, value l of sub-block j's fifth bit in bit j of qh[l]], then
    128 bytes of low 4 bits (32-byte chunk c holds sub-block 2c in the low nibbles and
    2c+1 in the high nibbles).  Value = d*sc[j]*q - dmin*m[j].
    """
    rows = np.asarray(rows, dtype=np.float32)
    shape = rows.shape
    assert shape[-1] % QK_K == 0
    top = (1 << bits) - 1
    x = rows.reshape(-1, 8, 32)
    nb = x.shape[0]
    xmin = x.min(axis=-1)
    xmax = x.max(axis=-1)
    mins = np.maximum(-xmin, 0.0)  # offset subtracted at dequant time (>= 0)
    scales = np.maximum(xmax + mins, 0.0) / top
    d = _f16_round(scales.max(axis=-1) / 63.0)
    dmin = _f16_round(mins.max(axis=-1) / 63.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scales / d[:, None]), 0)
        m = np.where(dmin[:, None] > 0, np.rint(mins / dmin[:, None]), 0)
    sc = np.clip(sc, 0, 63).astype(np.uint8)
    m = np.clip(m, 0, 63).astype(np.uint8)
    eff_scale = d[:, None] * sc  # (nb, 8)
    eff_min = dmin[:, None] * m
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff_scale[..., None] > 0, np.rint((x + eff_min[..., None]) / eff_scale[..., None]), 0)
    q = np.clip(q, 0, top).astype(np.uint8)  # (nb, 8, 32)

    packed_sc = np.zeros((nb, 12), dtype=np.uint8)
    packed_sc[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed_sc[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed_sc[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)

    parts = [d.astype(np.float16).view(np.uint8).reshape(nb, 2),
             dmin.astype(np.float16).view(np.uint8).reshape(nb, 2), packed_sc]
    if bits == 5:
        fifth = (q >> 4).astype(np.uint8)  # (nb, 8 sub-blocks, 32)
        parts.append(np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    low = (q & 0x0F).reshape(nb, 4, 2, 32)
    parts.append((low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(nb, 128))
    out = np.concatenate(parts, axis=1)
    block = 144 if bits == 4 else 176
    assert out.shape[1] == block
    return out.reshape(*shape[:-1], shape[-1] // QK_K * block)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Pack float rows (row length % 256 == 0) into GGML Q4_K blocks (144 bytes each)."""
    return _quantize_k_with_mins(rows, 4)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    """Pack float rows (row length % 256 == 0) into GGML Q5_K blocks (176 bytes each)."""
    return _quantize_k_with_mins(rows, 5)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Pack float rows (row length % 256 == 0) into GGML Q6_K blocks (210 bytes each).

    Block: ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16] (one per 16
    values), f16 d.  Value = d*scales[j]*(q - 32) with q in 0..63.  Element e of the
    block lives in group g=e//32 (i=e%32), h=g//4, r=g%4: low nibble (r//2 selects
    nibble) of ql[64h + 32(r%2) + i] and bits 2r..2r+1 of qh[32h + i].
    """
    rows = np.asarray(rows, dtype=np.float32)
    shape = rows.shape
    assert shape[-1] % QK_K == 0
    x = rows.reshape(-1, 16, 16)
    nb = x.shape[0]
    sub_scale = np.abs(x).max(axis=-1) / 31.0  # q-32 in [-31, 31]
    d = _f16_round(sub_scale.max(axis=-1) / 127.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(sub_scale / d[:, None]), 0)
    sc = np.clip(sc, -128, 127).astype(np.int8)
    eff = d[:, None] * sc.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff[..., None] != 0, np.rint(x / eff[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(nb, 256)

    q = q.reshape(nb, 2, 4, 32)  # [half h, group-in-half r, i]
    lo = q & np.uint8(0x0F)
    hi = q >> np.uint8(4)
    ql = (lo[:, :, 0:2, :] | (lo[:, :, 2:4, :] << np.uint8(4))).reshape(nb, 128)
    qh = (hi[:, :, 0, :] | (hi[:, :, 1, :] << np.uint8(2)) | (hi[:, :, 2, :] << np.uint8(4))
          | (hi[:, :, 3, :] << np.uint8(6))).reshape(nb, 64)

    out = np.concatenate(
        [ql, qh, sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(nb, 2)], axis=1
    )
    assert out.shape[1] == 210
    return out.reshape(*shape[:-1], shape[-1] // QK_K * 210)


# E2M1's 16 codes (sign bit 3, then 2 exponent and 1 mantissa bits), as values.
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
QK_MXFP4 = 32


def quantize_mxfp4(rows: np.ndarray) -> np.ndarray:
    """MXFP4 blocks of float rows (last axis a multiple of 32) as GGML stores them: per 32 values
    one E8M0 exponent byte (scale 2^(e-127)), then 16 bytes whose low nibbles are values 0-15
    and high nibbles values 16-31, each an E2M1 code."""
    shape = rows.shape
    assert shape[-1] % QK_MXFP4 == 0, "MXFP4 rows are whole 32-value blocks"
    blocks = np.asarray(rows, dtype=np.float64).reshape(-1, QK_MXFP4)
    amax = np.abs(blocks).max(axis=1)
    # the largest value lands in [4, 8) before rounding to E2M1 (whose top is 6), OCP MX's choice
    with np.errstate(divide="ignore"):
        exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127)
    biased = np.clip(exp + 127, 0, 254).astype(np.uint8)
    scale = np.exp2(biased.astype(np.float64) - 127)
    codes = np.abs(blocks[:, :, None] / scale[:, None, None] - _E2M1[None, None, :]).argmin(axis=2).astype(np.uint8)
    nibbles = codes[:, :16] | (codes[:, 16:] << 4)
    out = np.concatenate([biased[:, None], nibbles], axis=1)
    return out.reshape(*shape[:-1], shape[-1] // QK_MXFP4 * 17)


def dequantize_mxfp4(raw: np.ndarray) -> np.ndarray:
    """Float64 values of MXFP4 rows (the last axis whole 17-byte blocks), the inverse of quantize_mxfp4."""
    shape = raw.shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 17)
    scale = np.exp2(blocks[:, 0].astype(np.float64) - 127)
    codes = np.concatenate([blocks[:, 1:] & 0x0F, blocks[:, 1:] >> 4], axis=1)
    return (_E2M1[codes] * scale[:, None]).reshape(*shape[:-1], shape[-1] // 17 * QK_MXFP4)


# IQ4_NL's fixed non-linear 4-bit levels (the format's table).
_IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def quantize_iq4_nl(rows: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of 32: an f16 scale, then 16 bytes of level indices (value j in the
    low nibble of byte j, value j + 16 in its high nibble); each value takes the nearest
    level of scale * _IQ4_NL_LEVELS, the scale chosen so the block's largest magnitude
    lands on the outer level of its sign (gguf-py has no IQ4_NL quantizer)."""
    blocks = rows.reshape(-1, 32).astype(np.float32)
    peak = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
    scale = np.where(peak < 0, peak / -127.0, peak / 113.0)
    d = _f16_round(scale)
    levels = d[:, None] * _IQ4_NL_LEVELS[None, :]
    idx = np.abs(blocks[:, :, None] - levels[:, None, :]).argmin(axis=2).astype(np.uint8)
    packed = idx[:, :16] | (idx[:, 16:] << 4)
    out = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), packed], axis=1)
    return out.reshape(rows.shape[0], -1)


def quantize_tensor(data: np.ndarray, wtype: str) -> tuple[np.ndarray, QT]:
    """Return (array for GGUFWriter.add_tensor, raw GGML type)."""
    qt = WEIGHT_TYPES[wtype]
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qt == QT.Q4_K:
        return quantize_q4_k(data), qt
    if qt == QT.Q5_K:
        return quantize_q5_k(data), qt
    if qt == QT.Q6_K:
        return quantize_q6_k(data), qt
    if qt == QT.IQ4_NL:
        return quantize_iq4_nl(data), qt
    return gguf.quants.quantize(data, qt), qt


def hook_tensor(tensor_hook, tname: str, data: np.ndarray) -> np.ndarray:
    """data as tensor_hook(tname, data) makes it (None: unchanged), which may not change its shape."""
    if tensor_hook is None:
        return data
    out = np.asarray(tensor_hook(tname, data), dtype=np.float32)
    if out.shape != data.shape:
        raise ValueError(f"tensor_hook changed {tname}'s shape from {data.shape} to {out.shape}")
    return out


def override_type(tname: str, wtype: str, overrides: Mapping[str, str] | None) -> str:
    """wtype, or the type of the last fnmatch pattern in overrides that tname matches."""
    for pattern, t in (overrides or {}).items():
        if fnmatch.fnmatchcase(tname, pattern):
            wtype = t
    return wtype


def _block_size(wtype: str) -> int:
    return gguf.GGML_QUANT_SIZES[WEIGHT_TYPES[wtype]][0]


def resolve_type(wtype: str, row_len: int, strict: bool = False) -> str:
    wtype = wtype.lower()
    if wtype not in WEIGHT_TYPES:
        raise ValueError(f"unsupported weight type {wtype!r}; choose from {sorted(WEIGHT_TYPES)}")
    while row_len % _block_size(wtype) != 0:
        if strict or wtype not in _FALLBACK:
            raise ValueError(f"row length {row_len} is not a multiple of {wtype}'s block size {_block_size(wtype)}")
        wtype = _FALLBACK[wtype]
    return wtype


# --------------------------------------------------------------------------- vocab

# Words whose every prefix goes into the vocab, so a SentencePiece-style merge of
# single characters can reach the whole word.
_WORDS = ("▁The", "▁the", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "▁Hello", "▁hello", "▁world", "▁a", "▁and")


def build_vocab(arch: str, n_vocab: int | None, extra_pieces: Sequence[str] = ()) -> dict:
    """A small SentencePiece-style ("llama" tokenizer model) vocabulary.

    Special ids follow the family's convention: gemma3 <pad>=0 <eos>=1 <bos>=2 <unk>=3;
    the others <unk>=0 <s>=1 </s>=2.  Then the 256 byte-fallback tokens <0x00>..<0xFF>
    (type BYTE), printable ASCII (space written as '▁'), the prefixes of a few words and
    ``extra_pieces`` whole (e.g. a reranker's "yes" and "no").  Padded with <unusedN>
    (CONTROL) up to ``n_vocab``; if ``n_vocab`` is smaller than the natural size the
    trailing word pieces are dropped (minimum: specials+bytes).
    """
    if arch == "gemma3":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
        ids = dict(pad=0, eos=1, bos=2, unk=3)
    else:
        specials = ["<unk>", "<s>", "</s>"]
        ids = dict(unk=0, bos=1, eos=2, pad=None)
    tokens: list[str] = list(specials)
    types: list[int] = [int(gguf.TokenType.UNKNOWN) if t == "<unk>" else int(gguf.TokenType.CONTROL) for t in specials]
    scores: list[float] = [0.0] * len(specials)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(int(gguf.TokenType.BYTE))
        scores.append(0.0)
    n_min = len(tokens)
    pieces: list[str] = ["▁"] + [chr(c) for c in range(33, 127)]
    seen = set(pieces)
    for w in _WORDS:
        for k in range(2, len(w) + 1):
            p = w[:k]
            if p not in seen:
                seen.add(p)
                pieces.append(p)
    pieces += [p for p in extra_pieces if p not in seen]
    for p in pieces:
        tokens.append(p)
        types.append(int(gguf.TokenType.NORMAL))
        # SentencePiece merges the adjacent pair whose result has the highest score:
        # longer pieces score higher so words assemble fully.
        scores.append(-100.0 + 10.0 * len(p) - 0.001 * len(tokens))
    if n_vocab is not None:
        if n_vocab < n_min:
            raise ValueError(f"n_vocab must be >= {n_min} (specials + 256 byte tokens)")
        if n_vocab < len(tokens):
            del tokens[n_vocab:], types[n_vocab:], scores[n_vocab:]
        k = 0
        while len(tokens) < n_vocab:
            tokens.append(f"<unused{k}>")
            types.append(int(gguf.TokenType.CONTROL))
            scores.append(0.0)
            k += 1
    return dict(tokens=tokens, types=types, scores=scores, **ids)


# --------------------------------------------------------------------------- writer

_DEFAULTS = {
    # gemma3 mirrors the 270M's proportions (4 q heads on 1 kv head, head_dim set
    # explicitly), with 6 layers so the pattern has one global layer (layer 5) and a
    # short sliding window so tests with a few dozen tokens exercise the mask.
    "gemma3": dict(n_layer=6, n_embd=256, n_head=4, n_head_kv=1, head_dim=64, n_ff=512,
                   rope_freq_base=1_000_000.0, rms_eps=1e-6, sliding_window=16, tie_embeddings=True),
    "llama": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                  rope_freq_base=10_000.0, rms_eps=1e-5, sliding_window=None, tie_embeddings=False),
    "qwen2": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                  rope_freq_base=1_000_000.0, rms_eps=1e-6, sliding_window=None, tie_embeddings=True),
    # qwen3: head_dim deliberately != n_embd/n_head (as in Qwen3-0.6B: 16*128 != 1024)
    "qwen3": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=128, n_ff=512,
                  rope_freq_base=1_000_000.0, rms_eps=1e-6, sliding_window=None, tie_embeddings=True),
    # qwen3moe: Qwen3-30B-A3B's layout (head_dim 128 != n_embd/n_head, an untied head; 2 of 8
    # experts routed where it routes 8 of 128), experts n_embd wide so that every K-quant applies
    "qwen3moe": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=128, n_ff=512,
                     rope_freq_base=1_000_000.0, rms_eps=1e-6, sliding_window=None, tie_embeddings=False,
                     n_expert=8, n_expert_used=2, n_ff_exp=256),
}


def write_tiny_model(
    path: str | os.PathLike,
    arch: str,
    *,
    weight_type: str = "q8_0",
    n_layer: int | None = None,
    n_embd: int | None = None,
    n_head: int | None = None,
    n_head_kv: int | None = None,
    head_dim: int | None = None,
    n_ff: int | None = None,
    n_expert: int | None = None,
    n_expert_used: int | None = None,
    n_ff_exp: int | None = None,
    n_vocab: int | None = None,
    context_length: int = 512,
    sliding_window: int | None | str = "default",
    rope_freq_base: float | None = None,
    rope_scaling_factor: float | None = None,
    n_rot: int | None = None,
    rope_freqs: bool = False,
    rms_eps: float | None = None,
    final_logit_softcapping: float | None = None,
    tie_embeddings: bool | None = None,
    embd_type: str | None = None,
    type_overrides: Mapping[str, str] | None = None,
    strict: bool = False,
    seed: int = 0,
    name: str | None = None,
    extra_pieces: Sequence[str] = (),
    extend: Callable[[gguf.GGUFWriter, np.random.Generator], None] | None = None,
    tensor_hook: Callable[[str, np.ndarray], np.ndarray] | None = None,
    vocab_hook: Callable[[dict], None] | None = None,
) -> str:
    """Write a tiny random-weight GGUF for ``arch`` to ``path`` and return the path.

    Parameters left as ``None`` take per-arch defaults (see ``_DEFAULTS``); all
    defaults have row lengths that are multiples of 256, so every weight type applies
    without fallback.  ``sliding_window``: gemma3 only ("default" -> 16; ``None`` -> no
    key, i.e. every layer global as in llama.cpp).  ``rope_scaling_factor`` writes
    ``rope.scaling.type=linear`` + ``rope.scaling.factor`` (for gemma3 it applies to the
    global layers only, as in Gemma 3 4B+).  ``embd_type`` sets token_embd's type
    (default: ``weight_type``; note llama.cpp files often keep it at q8_0/q6_k).
    ``n_rot`` writes ``rope.dimension_count`` (partial rotary when below head_dim);
    ``rope_freqs`` adds a ``rope_freqs.weight`` tensor of per-pair frequency divisors
    (Llama 3.1's rope scaling is stored that way).  ``extra_pieces`` adds whole tokens
    to the vocabulary; ``extend(writer, rng)`` adds metadata and tensors of its own last.
    ``tensor_hook(name, data)`` returns what to write for each tensor instead of its drawn
    float32 data (same shape; before quantization); ``vocab_hook(vocab)`` edits in place the
    vocabulary written as tokenizer metadata (build_vocab's dict plus the add_* flags and an
    optional "chat_template"; the tensors take their vocabulary size from it afterwards).
    ``n_expert``, ``n_expert_used`` and ``n_ff_exp`` size an expert arch's routed experts (an
    F32 router ``ffn_gate_inp``, as llama.cpp's converter and quantizer keep it, and 3-D
    ``ffn_{gate,up,down}_exps`` of ``weight_type``, patterns ``blk.*.ffn_*_exps.weight``).
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; choose from {SUPPORTED_ARCHS}")
    d = dict(_DEFAULTS[arch])
    n_layer = d["n_layer"] if n_layer is None else n_layer
    n_embd = d["n_embd"] if n_embd is None else n_embd
    n_head = d["n_head"] if n_head is None else n_head
    n_head_kv = d["n_head_kv"] if n_head_kv is None else n_head_kv
    if head_dim is None:
        head_dim = d["head_dim"] if n_embd == d["n_embd"] and n_head == d["n_head"] else n_embd // n_head
    n_ff = d["n_ff"] if n_ff is None else n_ff
    moe = arch in EXPERT_ARCHS
    if not moe and (n_expert, n_expert_used, n_ff_exp) != (None, None, None):
        raise ValueError(f"{arch} has no experts")
    if moe:
        n_expert = d["n_expert"] if n_expert is None else n_expert
        n_expert_used = d["n_expert_used"] if n_expert_used is None else n_expert_used
        n_ff_exp = d["n_ff_exp"] if n_ff_exp is None else n_ff_exp
    rope_freq_base = d["rope_freq_base"] if rope_freq_base is None else rope_freq_base
    rms_eps = d["rms_eps"] if rms_eps is None else rms_eps
    tie = d["tie_embeddings"] if tie_embeddings is None else tie_embeddings
    if sliding_window == "default":
        sliding_window = d["sliding_window"]
    if sliding_window is not None and arch != "gemma3":
        raise ValueError("sliding_window is only modelled for gemma3")
    if arch == "gemma3" and not tie:
        raise ValueError("gemma3 always ties output to token_embd (llama.cpp has no output.weight for it)")
    if n_head % n_head_kv != 0:
        raise ValueError("n_head must be a multiple of n_head_kv")
    if head_dim % 2 != 0:
        raise ValueError("head_dim must be even (RoPE rotates pairs)")

    # add_space_prefix only for gemma3, as in the real gemma-3 file
    vocab = {**build_vocab(arch, n_vocab, extra_pieces), "add_bos": True, "add_eos": False,
             "add_space_prefix": False if arch == "gemma3" else None}
    if vocab_hook is not None:
        vocab_hook(vocab)
    n_vocab = len(vocab["tokens"])
    rng = np.random.default_rng(seed)
    overrides = dict(type_overrides or {})

    def pick_type(tname: str, row_len: int) -> str:
        wt = embd_type if tname == "token_embd.weight" and embd_type is not None else weight_type
        return resolve_type(override_type(tname, wt, overrides), row_len, strict)

    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_type("model")
    w.add_name(name or f"tiny-{arch}")
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(rms_eps)
    # llama.cpp's converter writes key_length/value_length for gemma3 and qwen3 (and
    # whenever head_dim != n_embd/n_head); llama writes rope.dimension_count + vocab_size.
    if arch in ("gemma3", "qwen3", "qwen3moe") or head_dim * n_head != n_embd:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_vocab_size(n_vocab)
    if arch == "llama" or n_rot is not None:
        w.add_rope_dimension_count(head_dim if n_rot is None else n_rot)
    w.add_rope_freq_base(rope_freq_base)
    if sliding_window is not None:
        w.add_sliding_window(int(sliding_window))
    if rope_scaling_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope_scaling_factor))
    if final_logit_softcapping is not None:
        w.add_final_logit_softcapping(float(final_logit_softcapping))
    if moe:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff_exp)

    add_tokenizer(w, "llama", "default", vocab)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(int(_FILE_TYPES[weight_type.lower()]))

    def hooked(tname: str, data: np.ndarray) -> np.ndarray:
        return hook_tensor(tensor_hook, tname, data)

    def add_weight(tname: str, n_out: int, n_in: int, std: float, n_mat: int | None = None,
                   wtype: str | None = None) -> None:
        # numpy shape (n_out, n_in) == GGML ne [n_in, n_out]: rows are input-dim long;
        # n_mat of them (experts) are one 3-D tensor (n_mat, n_out, n_in).
        shape = (n_out, n_in) if n_mat is None else (n_mat, n_out, n_in)
        data = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        arr, qt = quantize_tensor(hooked(tname, data), wtype or pick_type(tname, n_in))
        w.add_tensor(tname, arr, raw_dtype=qt)

    def add_norm(tname: str, n: int, center: float = 1.0) -> None:
        # Stored as the multiplier actually applied (for gemma that is HF's 1 + w,
        # which llama.cpp's converter bakes in), so draw around ``center`` (1).
        w.add_tensor(tname, hooked(tname, (center * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)))

    def add_bias(tname: str, n: int) -> None:
        w.add_tensor(tname, hooked(tname, (0.1 * rng.standard_normal(n)).astype(np.float32)))

    q_dim = n_head * head_dim
    kv_dim = n_head_kv * head_dim
    # Scales: logits come out with std ~2 in every arch.  gemma3 multiplies the
    # embeddings by sqrt(n_embd) and ties the output head, which with naive scales
    # makes the model predict its input token; so its embeddings are drawn smaller,
    # output_norm ~4 restores the logit scale and post-norms ~2 let the layers
    # dominate the residual stream (the real 270M's norms are large too).
    embd_std = (0.5 if arch == "gemma3" else 2.0) / np.sqrt(n_embd)
    post_center = 2.0
    add_weight("token_embd.weight", n_vocab, n_embd, embd_std)
    add_norm("output_norm.weight", n_embd, 4.0 if arch == "gemma3" else 1.0)
    if rope_freqs:
        half = (head_dim if n_rot is None else n_rot) // 2
        # Divisors from 1 (high frequencies untouched) to 8 (the lowest), as in Llama 3.1.
        divisors = np.geomspace(1.0, 8.0, half).astype(np.float32)
        w.add_tensor("rope_freqs.weight", hooked("rope_freqs.weight", divisors))
    if not tie:
        add_weight("output.weight", n_vocab, n_embd, 2.0 / np.sqrt(n_embd))
    for il in range(n_layer):
        p = f"blk.{il}."
        add_norm(p + "attn_norm.weight", n_embd)
        add_weight(p + "attn_q.weight", q_dim, n_embd, 1.0 / np.sqrt(n_embd))
        add_weight(p + "attn_k.weight", kv_dim, n_embd, 1.0 / np.sqrt(n_embd))
        add_weight(p + "attn_v.weight", kv_dim, n_embd, 1.0 / np.sqrt(n_embd))
        if arch == "qwen2":
            add_bias(p + "attn_q.bias", q_dim)
            add_bias(p + "attn_k.bias", kv_dim)
            add_bias(p + "attn_v.bias", kv_dim)
        if arch in ("gemma3", "qwen3", "qwen3moe"):
            add_norm(p + "attn_q_norm.weight", head_dim)
            add_norm(p + "attn_k_norm.weight", head_dim)
        add_weight(p + "attn_output.weight", n_embd, q_dim, 1.0 / np.sqrt(q_dim))
        if arch == "gemma3":
            add_norm(p + "post_attention_norm.weight", n_embd, post_center)
        add_norm(p + "ffn_norm.weight", n_embd)
        if moe:
            # Router logits with a spread of ~3 keep the top experts' probabilities apart, so
            # that rounding in an engine does not flip which experts a token runs.
            add_weight(p + "ffn_gate_inp.weight", n_expert, n_embd, 3.0 / np.sqrt(n_embd), wtype="f32")
            add_weight(p + "ffn_gate_exps.weight", n_ff_exp, n_embd, 1.0 / np.sqrt(n_embd), n_expert)
            add_weight(p + "ffn_up_exps.weight", n_ff_exp, n_embd, 1.0 / np.sqrt(n_embd), n_expert)
            add_weight(p + "ffn_down_exps.weight", n_embd, n_ff_exp, 1.0 / np.sqrt(n_ff_exp), n_expert)
        else:
            add_weight(p + "ffn_gate.weight", n_ff, n_embd, 1.0 / np.sqrt(n_embd))
            add_weight(p + "ffn_up.weight", n_ff, n_embd, 1.0 / np.sqrt(n_embd))
            add_weight(p + "ffn_down.weight", n_embd, n_ff, 1.0 / np.sqrt(n_ff))
        if arch == "gemma3":
            add_norm(p + "post_ffw_norm.weight", n_embd, post_center)
    if extend is not None:
        extend(w, rng)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)
