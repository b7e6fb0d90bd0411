"""Write tiny Qwen3.5/3.6 hybrids (GGUF ``qwen35``, ``qwen35moe``) with random weights, laid out
as llama.cpp's converter writes Qwen3.5-9B and Qwen3.6-35B-A3B: the tensor names, GGML shapes,
metadata keys and F32 tensors of those files (``ssm_conv1d``, ``ssm_a``, ``ssm_dt.bias``, the
norms, the routers), a byte-level BPE vocabulary with ``tokenizer.ggml.pre`` "qwen35", and
optionally the multi-token-prediction block the converter appends (``nextn_predict_layers``).

The default shape keeps the real proportions where a tiny model can: three Gated DeltaNet
layers then a full-attention one (``full_attention_interval`` 4), more value than key heads in
the linear layers (value head h reading key head h % H_k), a query twice as wide as the heads
(query and output gate), a quarter of each head rotated in IMRoPE sections, an untied head.
``recurrent_layers`` writes ``attention.recurrent_layers`` instead of the interval.

Weight scales keep activations O(1), and the decays span short and long memories: ``ssm_a``
(``-exp(A_log)``) between -8 and -0.5 and ``softplus(dt_bias)`` between 0.005 and 0.1, so
``exp(g)`` ranges from about 0.45 to nearly 1 per token.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Sequence

import gguf
import numpy as np

from ..synthetic_bpe import build_bpe_vocab
from ..vocab_metadata import add_tokenizer
from .tiny_gguf import hook_tensor, override_type, quantize_tensor, resolve_type

ARCHS = ("qwen35", "qwen35moe")
ROPE_FREQ_BASE = 10_000_000.0   # Qwen3.5/3.6's


def write_tiny_qwen35(
    path: str | os.PathLike,
    arch: str = "qwen35",
    *,
    weight_type: str = "q8_0",
    n_layer: int = 4,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 64,
    n_rot: int = 16,
    rope_sections: Sequence[int] = (3, 3, 2, 0),
    n_ff: int = 512,
    d_conv: int = 4,
    d_state: int = 64,
    n_k_heads: int = 2,
    n_v_heads: int = 4,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 256,
    n_ff_shexp: int = 256,
    full_attention_interval: int | None = 4,
    recurrent_layers: Sequence[bool] | None = None,
    nextn_layers: int = 0,
    n_vocab: int = 512,
    tie_embeddings: bool = False,
    rms_eps: float = 1e-6,
    type_overrides: Mapping[str, str] | None = None,
    strict: bool = False,
    seed: int = 0,
    tensor_hook: Callable[[str, np.ndarray], np.ndarray] | None = None,
    extra_metadata: Mapping[str, object] | None = None,
) -> str:
    """Write a tiny random ``arch`` GGUF to ``path`` and return the path.

    ``weight_type`` is every matrix's type (a tiny_gguf type, with llama-quantize's fallbacks
    for odd rows unless ``strict``); ``type_overrides`` maps fnmatch patterns of tensor names
    to types (the F32 tensors' too, for malformed files). ``nextn_layers`` appends that many multi-token-prediction blocks (counted in
    ``block_count``, never run). ``tensor_hook(name, data)`` returns what to write instead of
    a tensor's drawn float32 data (same shape); ``extra_metadata`` adds or replaces keys
    (``None`` values drop a key) after the writer's own, for malformed-file tests."""
    if arch not in ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; choose from {ARCHS}")
    moe = arch == "qwen35moe"
    vocab = build_bpe_vocab("qwen35", n_vocab)
    rng = np.random.default_rng(seed)
    key_dim, value_dim = n_k_heads * d_state, n_v_heads * d_state
    conv_channels = 2 * key_dim + value_dim
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    if recurrent_layers is not None and len(recurrent_layers) != n_layer:
        raise ValueError(f"recurrent_layers has {len(recurrent_layers)} entries for {n_layer} layers")
    recurrent = (list(recurrent_layers) if recurrent_layers is not None
                 else [(il + 1) % (full_attention_interval or 4) != 0 for il in range(n_layer)])

    meta: dict[str, object] = {}
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_type("model")
    w.add_name(f"tiny-{arch}")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer + nextn_layers)
    if not moe:   # the MoE release's config has no dense width, so its file has no key
        w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if moe:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff_exp)
        w.add_expert_shared_feed_forward_length(n_ff_shexp)
    w.add_rope_dimension_sections(list(rope_sections))
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_state_size(d_state)
    w.add_ssm_group_count(n_k_heads)
    w.add_ssm_time_step_rank(n_v_heads)
    w.add_ssm_inner_size(value_dim)
    if recurrent_layers is not None:
        meta[f"{arch}.attention.recurrent_layers"] = [bool(b) for b in recurrent] + [False] * nextn_layers
    if full_attention_interval is not None:
        w.add_full_attention_interval(full_attention_interval)
    w.add_rope_dimension_count(n_rot)
    if nextn_layers:
        w.add_nextn_predict_layers(nextn_layers)
    meta.update(extra_metadata or {})
    _add_metadata(w, meta)
    add_tokenizer(w, "gpt2", vocab["pre"], vocab)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def hooked(tname: str, data: np.ndarray) -> np.ndarray:
        return hook_tensor(tensor_hook, tname, data)

    def matrix(tname: str, shape: tuple[int, ...], std: float) -> None:
        # numpy shape (..., n_out, n_in) == GGML ne [n_in, n_out, ...]
        data = hooked(tname, rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
        wtype = resolve_type(override_type(tname, weight_type, type_overrides), shape[-1], strict)
        arr, qt = quantize_tensor(data, wtype)
        w.add_tensor(tname, arr, raw_dtype=qt)

    def f32(tname: str, values: np.ndarray) -> None:
        data = hooked(tname, np.asarray(values, dtype=np.float32))
        forced = override_type(tname, "f32", type_overrides)   # a malformed file's: not f32
        arr, qt = quantize_tensor(data, forced) if forced != "f32" else (data, None)
        w.add_tensor(tname, arr, raw_dtype=qt)

    def norm(tname: str, n: int) -> None:
        f32(tname, 1.0 + 0.1 * rng.standard_normal(n))

    in_std = 1.0 / np.sqrt(n_embd)
    matrix("token_embd.weight", (n_vocab, n_embd), 2.0 / np.sqrt(n_embd))
    norm("output_norm.weight", n_embd)
    if not tie_embeddings:
        matrix("output.weight", (n_vocab, n_embd), 2.0 / np.sqrt(n_embd))
    for il in range(n_layer + nextn_layers):
        p = f"blk.{il}."
        norm(p + "attn_norm.weight", n_embd)
        if il < n_layer and recurrent[il]:
            matrix(p + "attn_qkv.weight", (conv_channels, n_embd), in_std)
            matrix(p + "attn_gate.weight", (value_dim, n_embd), in_std)
            # the converter squeezes HF's [channels, 1, d_conv] kernel; never quantized
            f32(p + "ssm_conv1d.weight", rng.standard_normal((conv_channels, d_conv)) / np.sqrt(d_conv))
            dt = rng.uniform(0.005, 0.1, n_v_heads)
            f32(p + "ssm_dt.bias", np.log(np.expm1(dt)))   # softplus(dt_bias) = dt
            f32(p + "ssm_a", -np.exp(rng.uniform(np.log(0.5), np.log(8.0), n_v_heads)))
            matrix(p + "ssm_beta.weight", (n_v_heads, n_embd), in_std)
            matrix(p + "ssm_alpha.weight", (n_v_heads, n_embd), 0.5 * in_std)
            norm(p + "ssm_norm.weight", d_state)
            matrix(p + "ssm_out.weight", (n_embd, value_dim), 1.0 / np.sqrt(value_dim))
        else:
            matrix(p + "attn_q.weight", (2 * q_dim, n_embd), in_std)
            matrix(p + "attn_k.weight", (kv_dim, n_embd), in_std)
            matrix(p + "attn_v.weight", (kv_dim, n_embd), in_std)
            norm(p + "attn_q_norm.weight", head_dim)
            norm(p + "attn_k_norm.weight", head_dim)
            matrix(p + "attn_output.weight", (n_embd, q_dim), 1.0 / np.sqrt(q_dim))
        norm(p + "post_attention_norm.weight", n_embd)
        _ffn(matrix, f32, norm, rng, p, moe, n_embd, n_ff, n_expert, n_ff_exp, n_ff_shexp)
        if il >= n_layer:   # the multi-token-prediction block's own tensors
            matrix(p + "nextn.eh_proj.weight", (n_embd, 2 * n_embd), in_std)
            norm(p + "nextn.enorm.weight", n_embd)
            norm(p + "nextn.hnorm.weight", n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def _ffn(matrix, f32, norm, rng, p: str, moe: bool, n_embd: int, n_ff: int, n_expert: int, n_ff_exp: int,
         n_ff_shexp: int) -> None:
    """A layer's FFN tensors: the dense SwiGLU, or an F32 router, 3-D experts and the shared
    expert with its F32 gate row ([1, n_embd] as the converter writes HF's shared_expert_gate)."""
    in_std = 1.0 / np.sqrt(n_embd)
    if not moe:
        matrix(p + "ffn_gate.weight", (n_ff, n_embd), in_std)
        matrix(p + "ffn_up.weight", (n_ff, n_embd), in_std)
        matrix(p + "ffn_down.weight", (n_embd, n_ff), 1.0 / np.sqrt(n_ff))
        return
    # router logits spread ~3 apart, so that rounding rarely flips a token's experts
    f32(p + "ffn_gate_inp.weight", rng.standard_normal((n_expert, n_embd)) * 3.0 * in_std)
    matrix(p + "ffn_gate_exps.weight", (n_expert, n_ff_exp, n_embd), in_std)
    matrix(p + "ffn_up_exps.weight", (n_expert, n_ff_exp, n_embd), in_std)
    matrix(p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff_exp), 1.0 / np.sqrt(n_ff_exp))
    f32(p + "ffn_gate_inp_shexp.weight", rng.standard_normal((1, n_embd)) * in_std)
    matrix(p + "ffn_gate_shexp.weight", (n_ff_shexp, n_embd), in_std)
    matrix(p + "ffn_up_shexp.weight", (n_ff_shexp, n_embd), in_std)
    matrix(p + "ffn_down_shexp.weight", (n_embd, n_ff_shexp), 1.0 / np.sqrt(n_ff_shexp))


def _add_metadata(w: gguf.GGUFWriter, meta: Mapping[str, object]) -> None:
    """Add (or, for keys the writer already holds, replace or with None drop) metadata fields."""
    for key, value in meta.items():
        w.kv_data[0].pop(key, None)
        if value is None:
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))
