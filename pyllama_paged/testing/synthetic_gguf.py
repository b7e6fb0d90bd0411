"""A random-weight GGUF the size of a model people run (Llama 3.2 1B/3B, Qwen 2.5 1.5B,
Gemma 3 4B, Gemma 4 E4B and 26B-A4B, Qwen3-30B-A3B, gpt-oss-20b, Qwen3.5-9B, Qwen3.6-35B-A3B,
or the 1.6B Gemma 3 the benchmarks have long used),
quantized like Q4_K_M (gpt-oss: like its release, MXFP4 experts and Q8_0 elsewhere), for
benchmarks where weight and KV bytes and prompt lengths must be realistic.

Presets (pyllama_paged/testing/synthetic_presets.py) give the real shapes; the tensor names,
metadata and tokenizer are those of llama.cpp's own files, so both our engine and llama.cpp
load the result. Gemma 3 files reuse the embedded default model's tokenizer; Llama and Qwen
files carry a synthetic byte-level BPE vocabulary of the real size and layout
(pyllama_paged/testing/synthetic_bpe.py). Weights are random quantized blocks written
directly (pyllama_paged/testing/synthetic_blocks.py), in the type mix llama.cpp's Q4_K_M
gives: Q4_K for every matrix, Q6_K for the output head (the embedding when it is tied) and
for attn_v and ffn_down (ffn_down_exps) in the layers that mix gives more bits; an expert
model's router (ffn_gate_inp) stays F32, as llama-quantize leaves it. (Q4_K_M's own rule for
models of exactly 8 experts, Q8_0 attn_k and attn_v, is not modelled: no preset has 8.)
Each tensor is drawn as it is written, so a file larger than memory (Qwen3-30B-A3B's 18 GB)
is never held whole.

    python -m pyllama_paged.testing.synthetic_gguf [--preset gemma3-1.6b] [--small]
        [--out bench/.models/<the preset's file name>]
        [--n-embd N] [--n-layer N] [--n-head N] [--n-head-kv N] [--n-ff N]
        [--n-expert N] [--n-expert-used N] [--n-ff-exp N] [--seed 0]

--out is relative to the working directory (a source checkout's root, run as `python -P -m ...`
there so that the source tree, which has no native library, does not shadow the installed package).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from ..gguf.reader import read_metadata
from . import synthetic_presets as presets
from .synthetic_blocks import (MXFP4_BYTES, Q4_K_BYTES, Q6_K_BYTES, Q8_0_BYTES, QK_32, QK_K, mxfp4_blocks,
                               q4_k_blocks, q6_k_blocks, q8_0_blocks)
from .reference.tiny_mmproj import write_tiny_mmproj
from .synthetic_bpe import build_bpe_vocab
from .synthetic_gemma4 import add_gemma4_hparams, add_gemma4_tensors
from .vocab_metadata import add_tokenizer

# Llama 3.2's long-context RoPE rule (its config's rope_scaling), which llama.cpp's converter
# stores as rope_freqs.weight: per-frequency divisors.
LLAMA3_ROPE = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192)


def more_bits(layer: int, n_layer: int) -> bool:
    """The layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K (llama.cpp's rule)."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def q4_k_m_type(name: str, n_layer: int, tied: bool) -> str:
    """The type llama.cpp's Q4_K_M gives weight matrix `name`: "Q6_K" or "Q4_K"."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    # a hybrid's attn_qkv (the linear layers' q/k/v) is counted with attn_v, as llama-quantize does
    more = (".attn_v.weight", ".attn_qkv.weight", ".ffn_down.weight", ".ffn_down_exps.weight",
            ".ffn_down_shexp.weight")
    if name.endswith(more) and more_bits(int(name.split(".")[1]), n_layer):
        return "Q6_K"
    return "Q4_K"


def mxfp4_mix_type(name: str) -> str:
    """The type gpt-oss's release gives weight matrix `name`: "MXFP4" for the experts, else "Q8_0"."""
    return "MXFP4" if name.endswith("_exps.weight") else "Q8_0"


# type -> (its block writer, bytes per block, values per block, GGML type)
_BLOCKS = {"Q4_K": (q4_k_blocks, Q4_K_BYTES, QK_K, QT.Q4_K), "Q6_K": (q6_k_blocks, Q6_K_BYTES, QK_K, QT.Q6_K),
           "Q8_0": (q8_0_blocks, Q8_0_BYTES, QK_32, QT.Q8_0), "MXFP4": (mxfp4_blocks, MXFP4_BYTES, QK_32, QT.MXFP4)}


def llama3_rope_divisors(head_dim: int, freq_base: float) -> np.ndarray:
    """rope_freqs.weight for Llama 3.2: 1 for short wavelengths, the factor for long ones,
    a smooth blend between (the rule of its rope_scaling config)."""
    r = LLAMA3_ROPE
    short, long = r["original_context"] / r["high_freq_factor"], r["original_context"] / r["low_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * freq_base ** (i / head_dim)
        if wavelength < short:
            out.append(1.0)
        elif wavelength > long:
            out.append(r["factor"])
        else:
            smooth = (r["original_context"] / wavelength - r["low_freq_factor"]) / (
                r["high_freq_factor"] - r["low_freq_factor"])
            out.append(1.0 / ((1 - smooth) / r["factor"] + smooth))
    return np.array(out, np.float32)


def _source_metadata(source: str | None) -> dict:
    """The default gemma3 model's metadata, for presets that copy its tokenizer."""
    from pyllama_paged.engine import default_model_path

    # strict: a token that is not UTF-8 must fail here, not be copied altered
    meta = read_metadata(source or default_model_path(), errors="strict")
    if meta.get("general.architecture") != "gemma3":
        raise ValueError("the source model must be a gemma3 GGUF (its tokenizer and metadata are reused)")
    return meta


def _tokenizer(p: presets.Preset, meta: dict | None) -> tuple[str, str, dict]:
    """(tokenizer model, pre-tokenizer, vocabulary) for the file: the source model's for
    presets that copy it, else a synthetic byte-level BPE vocabulary of the family's layout."""
    if p.tokenizer != "source":
        vocab = build_bpe_vocab(p.tokenizer, p.n_vocab)
        return "gpt2", vocab["pre"], vocab

    def get(key, default=None):
        return meta.get(f"tokenizer.ggml.{key}", default)

    return get("model"), get("pre"), dict(
        tokens=get("tokens"), scores=get("scores").tolist(), types=get("token_type").tolist(),
        bos=get("bos_token_id"), eos=get("eos_token_id"), unk=get("unknown_token_id"), pad=get("padding_token_id"),
        add_bos=get("add_bos_token", True), add_eos=get("add_eos_token", False),
        add_space_prefix=get("add_space_prefix", False), chat_template=meta.get("tokenizer.chat_template"))


def _add_hparams(w, p: presets.Preset, meta: dict | None, n_vocab: int) -> None:
    """The architecture's metadata keys, as llama.cpp's converter writes them."""
    def pick(value, key, kind):
        # gemma3 presets leave what the source model has to its file
        return kind(meta[f"gemma3.{key}"]) if value is None else value

    w.add_context_length(pick(p.context_length, "context_length", int))
    w.add_embedding_length(p.n_embd)
    w.add_block_count(p.n_layer)
    if p.arch != "qwen35moe":   # Qwen3.6-35B-A3B's config has no dense width, so its file no key
        w.add_feed_forward_length(p.n_ff)
    w.add_head_count(p.n_head)
    w.add_head_count_kv(p.kv_heads())
    if p.arch in ("gemma3", "qwen3moe", "gpt-oss", "gemma4") or p.hybrid or p.q_dim != p.n_embd:
        w.add_key_length(p.head_dim)
        w.add_value_length(p.head_dim)
    w.add_layer_norm_rms_eps(pick(p.rms_eps, "attention.layer_norm_rms_epsilon", float))
    w.add_rope_freq_base(pick(p.rope_freq_base, "rope.freq_base", float))
    if p.arch == "llama":
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(p.head_dim)
    if p.arch in ("gemma3", "gpt-oss", "gemma4"):
        w.add_sliding_window(pick(p.sliding_window, "attention.sliding_window", int))
    if p.yarn_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(p.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(p.yarn_original_context)
    if p.rope_scaling_linear is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(p.rope_scaling_linear)
    if p.n_expert:
        w.add_expert_count(p.n_expert)
        w.add_expert_used_count(p.n_expert_used)
        w.add_expert_feed_forward_length(p.n_ff_exp)
    if p.arch == "gemma4":
        add_gemma4_hparams(w, p)
    if p.hybrid:
        _add_hybrid_hparams(w, p)


def _add_hybrid_hparams(w, p: presets.Preset) -> None:
    """A Gated DeltaNet hybrid's keys, as llama.cpp's converter writes Qwen3.5's."""
    if p.n_ff_shexp:
        w.add_expert_shared_feed_forward_length(p.n_ff_shexp)
    w.add_rope_dimension_sections(list(p.rope_sections))
    w.add_ssm_conv_kernel(p.ssm_d_conv)
    w.add_ssm_state_size(p.ssm_d_state)
    w.add_ssm_group_count(p.ssm_n_group)
    w.add_ssm_time_step_rank(p.ssm_dt_rank)
    w.add_ssm_inner_size(p.ssm_dt_rank * p.ssm_d_state)
    w.add_full_attention_interval(p.full_attention_interval)
    w.add_rope_dimension_count(p.n_rot)


class _Tensors:
    """Declares random tensors to a writer, counting the parameters; write_data then draws
    and writes each in turn (in the order declared, which is also the order of the draws)."""

    def __init__(self, w, p: presets.Preset, rng: np.random.Generator):
        self.w, self.p, self.rng, self.n_params = w, p, rng, 0
        self._draws = []

    def _declare(self, name: str, shape: tuple, dtype, nbytes: int, draw, raw_dtype=None) -> None:
        self.w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=raw_dtype)
        self._draws.append(draw)

    def matrix(self, name: str, n_out: int, n_in: int, std: float, n_mat: int = 0) -> None:
        """A weight matrix in its type of the preset's mix; n_mat > 0: that many of them (experts)
        as one 3-D tensor."""
        kind = mxfp4_mix_type(name) if self.p.type_mix == "mxfp4" else q4_k_m_type(name, self.p.n_layer, self.p.tied)
        if n_in % _BLOCKS[kind][2]:   # rows that are not whole blocks of it: llama-quantize's fallback (as Q8_0)
            kind = "Q8_0"
        blocks, block_bytes, block_values, qtype = _BLOCKS[kind]
        shape = ((n_mat,) if n_mat else ()) + (n_out, n_in // block_values * block_bytes)
        rows = n_out * max(n_mat, 1)
        self._declare(name, shape, np.uint8, math.prod(shape),
                      lambda: blocks(self.rng, rows, n_in, std).reshape(shape), qtype)
        self.n_params += rows * n_in

    def float_matrix(self, name: str, n_out: int, n_in: int, std: float) -> None:
        """An f32 weight matrix (what llama-quantize does not quantize: an expert router)."""
        self._declare(name, (n_out, n_in), np.float32, 4 * n_out * n_in,
                      lambda: (std * self.rng.standard_normal((n_out, n_in))).astype(np.float32))
        self.n_params += n_out * n_in

    def vector(self, name: str, n: int, centre: float, spread: float) -> None:
        """An f32 norm weight (centre: the multiplier applied, which for gemma llama.cpp's
        converter bakes in as HF's 1 + w) or bias (centre 0)."""
        self._declare(name, (n,), np.float32, 4 * n,
                      lambda: (centre + spread * self.rng.standard_normal(n)).astype(np.float32))
        self.n_params += n

    def table(self, name: str, values: np.ndarray) -> None:
        """A fixed f32 table (not a parameter: not counted)."""
        self._declare(name, values.shape, np.float32, values.nbytes, lambda: values)

    def write_data(self) -> None:
        """Draw and write every declared tensor, after the writer wrote their infos."""
        for draw in self._draws:
            self.w.write_tensor_data(draw())
        self._draws = []


def _add_tensors(t: _Tensors, n_vocab: int) -> None:
    """Every tensor the architecture has, in llama.cpp's names and shapes."""
    p = t.p
    gemma = p.arch in ("gemma3", "gemma4")
    # gemma multiplies embeddings by sqrt(n_embd) and ties the head: small embeddings, an
    # output_norm near 4 and post-norms near 2 keep its logits from predicting the input
    # token (the scales of pyllama_paged/testing/reference/tiny_gguf.py); the others' tied or
    # untied heads give logits of std ~2 from embeddings of std 2 / sqrt(n_embd).
    embd_std = (0.5 if gemma else 2.0) / np.sqrt(p.n_embd)
    t.matrix("token_embd.weight", n_vocab, p.n_embd, embd_std)
    t.vector("output_norm.weight", p.n_embd, 4.0 if gemma else 1.0, 0.4 if gemma else 0.1)
    if not p.tied:
        t.matrix("output.weight", n_vocab, p.n_embd, embd_std)
    if p.llama3_rope:
        t.table("rope_freqs.weight", llama3_rope_divisors(p.head_dim, p.rope_freq_base))
    kv_dim, in_std = p.n_head_kv * p.head_dim, 1.0 / np.sqrt(p.n_embd)
    if p.arch == "gemma4":
        return add_gemma4_tensors(t, n_vocab)
    if p.arch == "gpt-oss":
        for il in range(p.n_layer):
            _add_gpt_oss_layer(t, f"blk.{il}.", kv_dim, in_std)
        return
    if p.hybrid:
        for il in range(p.n_layer):
            _add_hybrid_layer(t, il, kv_dim, in_std)
        return
    for il in range(p.n_layer):
        b = f"blk.{il}."
        t.vector(b + "attn_norm.weight", p.n_embd, 1.0, 0.1)
        t.matrix(b + "attn_q.weight", p.q_dim, p.n_embd, in_std)
        t.matrix(b + "attn_k.weight", kv_dim, p.n_embd, in_std)
        t.matrix(b + "attn_v.weight", kv_dim, p.n_embd, in_std)
        if p.arch == "qwen2":
            for name, n in (("attn_q.bias", p.q_dim), ("attn_k.bias", kv_dim), ("attn_v.bias", kv_dim)):
                t.vector(b + name, n, 0.0, 0.1)
        if gemma or p.arch == "qwen3moe":
            t.vector(b + "attn_q_norm.weight", p.head_dim, 1.0, 0.1)
            t.vector(b + "attn_k_norm.weight", p.head_dim, 1.0, 0.1)
        t.matrix(b + "attn_output.weight", p.n_embd, p.q_dim, 1.0 / np.sqrt(p.q_dim))
        if gemma:
            t.vector(b + "post_attention_norm.weight", p.n_embd, 2.0, 0.2)
        t.vector(b + "ffn_norm.weight", p.n_embd, 1.0, 0.1)
        if p.n_expert:
            t.float_matrix(b + "ffn_gate_inp.weight", p.n_expert, p.n_embd, in_std)
            t.matrix(b + "ffn_gate_exps.weight", p.n_ff_exp, p.n_embd, in_std, p.n_expert)
            t.matrix(b + "ffn_up_exps.weight", p.n_ff_exp, p.n_embd, in_std, p.n_expert)
            t.matrix(b + "ffn_down_exps.weight", p.n_embd, p.n_ff_exp, 1.0 / np.sqrt(p.n_ff_exp), p.n_expert)
        else:
            t.matrix(b + "ffn_gate.weight", p.n_ff, p.n_embd, in_std)
            t.matrix(b + "ffn_up.weight", p.n_ff, p.n_embd, in_std)
            t.matrix(b + "ffn_down.weight", p.n_embd, p.n_ff, 1.0 / np.sqrt(p.n_ff))
        if gemma:
            t.vector(b + "post_ffw_norm.weight", p.n_embd, 2.0, 0.2)


def _add_gpt_oss_layer(t: _Tensors, b: str, kv_dim: int, in_std: float) -> None:
    """A gpt-oss layer as llama.cpp's converter writes it: every projection with a bias, a sink
    logit per head, post_attention_norm (its FFN's norm), a router with a bias, experts with a
    bias row each."""
    p = t.p
    t.vector(b + "attn_norm.weight", p.n_embd, 1.0, 0.1)
    for name, n_out in (("attn_q", p.q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
        t.matrix(b + name + ".weight", n_out, p.n_embd, in_std)
        t.vector(b + name + ".bias", n_out, 0.0, 0.1)
    t.matrix(b + "attn_output.weight", p.n_embd, p.q_dim, 1.0 / np.sqrt(p.q_dim))
    t.vector(b + "attn_output.bias", p.n_embd, 0.0, 0.1)
    t.vector(b + "attn_sinks.weight", p.n_head, 1.0, 1.0)
    t.vector(b + "post_attention_norm.weight", p.n_embd, 1.0, 0.1)
    t.float_matrix(b + "ffn_gate_inp.weight", p.n_expert, p.n_embd, in_std)
    t.vector(b + "ffn_gate_inp.bias", p.n_expert, 0.0, 0.1)
    for name, n_out, n_in in (("ffn_gate_exps", p.n_ff_exp, p.n_embd), ("ffn_up_exps", p.n_ff_exp, p.n_embd),
                              ("ffn_down_exps", p.n_embd, p.n_ff_exp)):
        t.matrix(b + name + ".weight", n_out, n_in, 1.0 / np.sqrt(n_in), p.n_expert)
        t.float_matrix(b + name + ".bias", p.n_expert, n_out, 0.1)


def write_metadata(out: Path, preset: str | presets.Preset, *, source: str | None = None) -> str:
    """The preset's file without its tensors: the metadata alone (its config, KV sizes), at once
    for the largest preset."""
    p = presets.get(preset) if isinstance(preset, str) else preset
    p.check()
    w = gguf.GGUFWriter(str(out), p.arch)
    meta = _source_metadata(source) if p.tokenizer == "source" else None
    model, pre, vocab = _tokenizer(p, meta)
    _add_hparams(w, p, meta, len(vocab["tokens"]))
    add_tokenizer(w, model, pre, vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return str(out)


def _add_hybrid_layer(t: _Tensors, il: int, kv_dim: int, in_std: float) -> None:
    """A Qwen3.5 layer as llama.cpp's converter writes it: a Gated DeltaNet mixer (F32 kernel,
    decay and bias) or a full-attention one whose query is twice as wide (query and output gate),
    post_attention_norm as the FFN's norm, a dense FFN or experts with a gated shared expert."""
    p, b = t.p, f"blk.{il}."
    t.vector(b + "attn_norm.weight", p.n_embd, 1.0, 0.1)
    if (il + 1) % p.full_attention_interval:
        key_dim, value_dim = p.ssm_n_group * p.ssm_d_state, p.ssm_dt_rank * p.ssm_d_state
        t.matrix(b + "attn_qkv.weight", 2 * key_dim + value_dim, p.n_embd, in_std)
        t.matrix(b + "attn_gate.weight", value_dim, p.n_embd, in_std)
        t.float_matrix(b + "ssm_conv1d.weight", 2 * key_dim + value_dim, p.ssm_d_conv, 0.5)
        t.vector(b + "ssm_dt.bias", p.ssm_dt_rank, -3.0, 0.5)   # softplus(-3) = 0.05
        t.vector(b + "ssm_a", p.ssm_dt_rank, -2.0, 0.5)         # -exp(A_log)
        t.matrix(b + "ssm_beta.weight", p.ssm_dt_rank, p.n_embd, in_std)
        t.matrix(b + "ssm_alpha.weight", p.ssm_dt_rank, p.n_embd, in_std)
        t.vector(b + "ssm_norm.weight", p.ssm_d_state, 1.0, 0.1)
        t.matrix(b + "ssm_out.weight", p.n_embd, value_dim, 1.0 / np.sqrt(value_dim))
    else:
        t.matrix(b + "attn_q.weight", 2 * p.q_dim, p.n_embd, in_std)
        t.matrix(b + "attn_k.weight", kv_dim, p.n_embd, in_std)
        t.matrix(b + "attn_v.weight", kv_dim, p.n_embd, in_std)
        t.vector(b + "attn_q_norm.weight", p.head_dim, 1.0, 0.1)
        t.vector(b + "attn_k_norm.weight", p.head_dim, 1.0, 0.1)
        t.matrix(b + "attn_output.weight", p.n_embd, p.q_dim, 1.0 / np.sqrt(p.q_dim))
    t.vector(b + "post_attention_norm.weight", p.n_embd, 1.0, 0.1)
    if not p.n_expert:
        t.matrix(b + "ffn_gate.weight", p.n_ff, p.n_embd, in_std)
        t.matrix(b + "ffn_up.weight", p.n_ff, p.n_embd, in_std)
        t.matrix(b + "ffn_down.weight", p.n_embd, p.n_ff, 1.0 / np.sqrt(p.n_ff))
        return
    t.float_matrix(b + "ffn_gate_inp.weight", p.n_expert, p.n_embd, in_std)
    t.matrix(b + "ffn_gate_exps.weight", p.n_ff_exp, p.n_embd, in_std, p.n_expert)
    t.matrix(b + "ffn_up_exps.weight", p.n_ff_exp, p.n_embd, in_std, p.n_expert)
    t.matrix(b + "ffn_down_exps.weight", p.n_embd, p.n_ff_exp, 1.0 / np.sqrt(p.n_ff_exp), p.n_expert)
    t.float_matrix(b + "ffn_gate_inp_shexp.weight", 1, p.n_embd, in_std)
    t.matrix(b + "ffn_gate_shexp.weight", p.n_ff_shexp, p.n_embd, in_std)
    t.matrix(b + "ffn_up_shexp.weight", p.n_ff_shexp, p.n_embd, in_std)
    t.matrix(b + "ffn_down_shexp.weight", p.n_embd, p.n_ff_shexp, 1.0 / np.sqrt(p.n_ff_shexp))


def write(out: Path, preset: str | presets.Preset = presets.DEFAULT, *, seed: int = 0,
          source: str | None = None, **shape) -> dict:
    """Write the preset's model (its fields overridden by shape, e.g. n_layer=2) to out;
    returns its shape and parameter count."""
    p = presets.get(preset) if isinstance(preset, str) else preset
    p = dataclasses.replace(p, **shape)
    p.check()
    meta = _source_metadata(source) if p.tokenizer == "source" else None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), p.arch)
    w.add_name(f"{p.name} synthetic (random weights) {p.n_embd}x{p.n_layer}")
    model, pre, vocab = _tokenizer(p, meta)
    n_vocab = len(vocab["tokens"])
    _add_hparams(w, p, meta, n_vocab)   # before the tokenizer, as llama.cpp's converter orders them
    add_tokenizer(w, model, pre, vocab)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE if p.type_mix == "mxfp4" else gguf.LlamaFileType.MOSTLY_Q4_K_M))
    tensors = _Tensors(w, p, np.random.default_rng(seed))
    _add_tensors(tensors, n_vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    tensors.write_data()
    w.close()
    return {"path": str(out), "preset": p.name, "arch": p.arch, "n_embd": p.n_embd, "n_layer": p.n_layer,
            "n_head": p.n_head, "n_head_kv": p.n_head_kv, "n_ff": p.n_ff, "head_dim": p.head_dim,
            "n_expert": p.n_expert, "n_expert_used": p.n_expert_used, "n_ff_exp": p.n_ff_exp,
            "n_vocab": n_vocab, "n_params": tensors.n_params, "bytes": out.stat().st_size}


# Gemma 3 4B-27B's vision tower (SigLIP so400m at 896 pixels, 14-pixel patches, 4 x 4 pooled).
GEMMA3_SIGLIP = dict(image_size=896, patch_size=14, n_embd=1152, n_head=16, n_ff=4304, n_layer=27, scale_factor=4)


def main(argv=None) -> int:
    """Command line: write one preset (optionally shrunk or reshaped) and print its size."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=presets.DEFAULT, choices=list(presets.PRESETS))
    ap.add_argument("--small", action="store_true", help="the preset's scaled-down copy (2 layers), as tests use")
    ap.add_argument("--out", help="default: bench/.models/<the preset's file name>")
    for flag in ("n-embd", "n-layer", "n-head", "n-head-kv", "n-ff", "n-expert", "n-expert-used", "n-ff-exp"):
        ap.add_argument(f"--{flag}", type=int, help="override the preset's value")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mmproj", metavar="FILE", help="also write a random vision projector for the model "
                    "(gemma3 presets: Gemma 3's SigLIP tower, or with --small a tiny one)")
    args = ap.parse_args(argv)
    p = presets.get(args.preset)
    if args.small:
        p = presets.shrink(p)
    shape = {k: v for k in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "n_expert", "n_expert_used",
                            "n_ff_exp") if (v := getattr(args, k)) is not None}
    if args.mmproj and p.arch != "gemma3":
        ap.error("--mmproj: only gemma3 presets have a projector writer")
    out = Path(args.out or Path("bench") / ".models" / p.file_name)
    info = write(out, p, seed=args.seed, **shape)
    print(f"{info['path']}: {info['preset']}, {info['n_params'] / 1e9:.2f}B parameters, "
          f"{info['bytes'] / 2**20:.0f} MiB")
    if args.mmproj:
        sizes = {} if args.small else GEMMA3_SIGLIP
        print(write_tiny_mmproj(args.mmproj, projection_dim=info["n_embd"], seed=args.seed, **sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
