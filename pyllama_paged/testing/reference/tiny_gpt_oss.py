"""Write tiny gpt-oss GGUF models with random weights, laid out as llama.cpp's converter writes
gpt-oss-20b: the tensor names, GGML shapes and metadata keys of its file, MXFP4 expert
matrices, F32 biases, sinks and router, and a byte-level BPE vocabulary with o200k_harmony's
special tokens (``tokenizer.ggml.pre`` "gpt-4o", testing/synthetic_bpe.py's "gpt-oss" family)
and a harmony chat template.

The shapes follow the real model where a tiny one can (head_dim 64 with n_embd / n_head != 64,
more query than KV heads, an untied head, a sliding layer then a full one, YaRN over a short
original context); the window is short so that tests with a few dozen tokens cross it. YaRN's
factor is the real 32: positions far below the original context still see it, since the
interpolated pairs' angles shrink 32-fold and every cos/sin is scaled by 1 + 0.1 ln 32.

Weight scales keep activations O(1) (expert pre-activations of std ~1: the clamp at 7 is
rarely reached, since GGML quantizes the down projection's input to Q8_0 blocks for an MXFP4
product, and inputs of a wide range there cost the engine its precision; a test scales the
experts up to reach the clamp), and router logits are spread so that top-k choices are
rarely near ties.
"""

from __future__ import annotations

import os
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from ..synthetic_bpe import build_bpe_vocab
from ..vocab_metadata import add_tokenizer
from .tiny_gguf import hook_tensor, quantize_mxfp4, quantize_tensor, resolve_type

ARCH = "gpt-oss"
# the real model's rope (gpt-oss-20b and 120b alike)
ROPE_FREQ_BASE = 150000.0
YARN_FACTOR = 32.0


def write_tiny_gpt_oss(
    path: str | os.PathLike,
    *,
    weight_type: str = "q8_0",
    expert_type: str = "mxfp4",
    n_layer: int = 2,
    n_embd: int = 256,
    n_head: int = 8,
    n_head_kv: int = 2,
    head_dim: int = 64,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 256,
    n_vocab: int = 512,
    sliding_window: int = 8,
    original_context: int = 256,
    yarn_factor: float = YARN_FACTOR,
    rms_eps: float = 1e-5,
    seed: int = 0,
    name: str | None = None,
    tensor_hook: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> str:
    """Write a tiny random gpt-oss GGUF to ``path`` and return the path.

    ``weight_type`` is the attention projections', the embedding's and the head's type (a
    tiny_gguf type, with its fallbacks); ``expert_type`` the expert matrices' ("mxfp4", as in
    gpt-oss's release, or any tiny_gguf type). ``tensor_hook(name, data)`` returns what to
    write instead of a tensor's drawn float32 data (same shape, before quantization)."""
    if n_embd % 32 or n_ff_exp % 32:
        raise ValueError("n_embd and n_ff_exp must be multiples of 32 (MXFP4 blocks)")
    if n_head % n_head_kv:
        raise ValueError("n_head must be a multiple of n_head_kv")
    vocab = build_bpe_vocab("gpt-oss", n_vocab)
    rng = np.random.default_rng(seed)
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim

    w = gguf.GGUFWriter(os.fspath(path), ARCH)
    w.add_type("model")
    w.add_name(name or "tiny-gpt-oss")
    w.add_context_length(int(original_context * yarn_factor))
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff_exp)   # the converter writes intermediate_size, the experts' width
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(yarn_factor))
    w.add_rope_scaling_orig_ctx_len(int(original_context))
    # gpt-oss's config.json gives them; llama.cpp reads neither (its defaults are these)
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_sliding_window(int(sliding_window))
    w.add_expert_feed_forward_length(n_ff_exp)
    add_tokenizer(w, "gpt2", vocab["pre"], vocab)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE if expert_type == "mxfp4" else gguf.LlamaFileType.MOSTLY_Q8_0))

    def hooked(tname: str, data: np.ndarray) -> np.ndarray:
        return hook_tensor(tensor_hook, tname, data)

    def add_weight(tname: str, shape: tuple[int, ...], std: float, wtype: str) -> None:
        # numpy shape (..., n_out, n_in) == GGML ne [n_in, n_out, ...]
        data = hooked(tname, rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
        if wtype == "mxfp4":
            w.add_tensor(tname, quantize_mxfp4(data), raw_dtype=QT.MXFP4)
        elif wtype == "f32":
            w.add_tensor(tname, np.ascontiguousarray(data, dtype=np.float32))
        else:
            arr, qt = quantize_tensor(data, resolve_type(wtype, shape[-1]))
            w.add_tensor(tname, arr, raw_dtype=qt)

    def add_f32(tname: str, shape: tuple[int, ...], center: float, std: float) -> None:
        w.add_tensor(tname, hooked(tname, (center + std * rng.standard_normal(shape)).astype(np.float32)))

    add_weight("token_embd.weight", (n_vocab, n_embd), 2.0 / np.sqrt(n_embd), weight_type)
    add_f32("output_norm.weight", (n_embd,), 1.0, 0.1)
    add_weight("output.weight", (n_vocab, n_embd), 2.0 / np.sqrt(n_embd), weight_type)
    for il in range(n_layer):
        p = f"blk.{il}."
        add_f32(p + "attn_norm.weight", (n_embd,), 1.0, 0.1)
        add_weight(p + "attn_q.weight", (q_dim, n_embd), 1.0 / np.sqrt(n_embd), weight_type)
        add_f32(p + "attn_q.bias", (q_dim,), 0.0, 0.1)
        add_weight(p + "attn_k.weight", (kv_dim, n_embd), 1.0 / np.sqrt(n_embd), weight_type)
        add_f32(p + "attn_k.bias", (kv_dim,), 0.0, 0.1)
        add_weight(p + "attn_v.weight", (kv_dim, n_embd), 1.0 / np.sqrt(n_embd), weight_type)
        add_f32(p + "attn_v.bias", (kv_dim,), 0.0, 0.1)
        add_weight(p + "attn_output.weight", (n_embd, q_dim), 1.0 / np.sqrt(q_dim), weight_type)
        add_f32(p + "attn_output.bias", (n_embd,), 0.0, 0.1)
        # about the size of a query's scores, so that a sink takes a real share of the softmax
        add_f32(p + "attn_sinks.weight", (n_head,), 1.0, 1.0)
        add_f32(p + "post_attention_norm.weight", (n_embd,), 1.0, 0.1)
        add_weight(p + "ffn_gate_inp.weight", (n_expert, n_embd), 6.0 / np.sqrt(n_embd), "f32")
        add_f32(p + "ffn_gate_inp.bias", (n_expert,), 0.0, 1.0)
        add_weight(p + "ffn_gate_exps.weight", (n_expert, n_ff_exp, n_embd), 1.0 / np.sqrt(n_embd), expert_type)
        add_f32(p + "ffn_gate_exps.bias", (n_expert, n_ff_exp), 0.0, 0.5)
        add_weight(p + "ffn_up_exps.weight", (n_expert, n_ff_exp, n_embd), 1.0 / np.sqrt(n_embd), expert_type)
        add_f32(p + "ffn_up_exps.bias", (n_expert, n_ff_exp), 0.0, 0.5)
        # the experts' share of the residual stream kept below the attention's: a wide FFN output
        # would magnify what rounding the attention's Q8_0 inputs costs (seen: 3% of the spread)
        add_weight(p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff_exp), 0.2 / np.sqrt(n_ff_exp), expert_type)
        add_f32(p + "ffn_down_exps.bias", (n_expert, n_embd), 0.0, 0.1)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)
