"""Gemma 4's part of the synthetic GGUF writer (synthetic_gguf.py): the metadata keys and tensors
llama.cpp's converter writes for it beyond what every architecture has (see
testing/reference/tiny_gemma4.py for the layout these follow), at a preset's real shapes."""

from __future__ import annotations

import numpy as np

from .reference.tiny_gemma4 import rope_divisors


def add_gemma4_hparams(w, p) -> None:
    """The sliding layers' shapes and rope, the shared-KV layers, the per-layer embeddings, the
    soft-cap (after the keys every architecture has)."""
    w.add_rope_freq_base_swa(10_000.0)
    if p.final_logit_softcap is not None:
        w.add_final_logit_softcapping(p.final_logit_softcap)
    w.add_shared_kv_layers(p.n_kv_shared)
    w.add_embedding_length_per_layer_input(p.n_embd_per_layer)
    w.add_sliding_window_pattern(p.sliding())
    head_swa = p.head_dim_swa or p.head_dim
    w.add_key_length_swa(head_swa)
    w.add_value_length_swa(head_swa)
    w.add_rope_dimension_count(p.head_dim)
    w.add_rope_dimension_count_swa(head_swa)


def add_gemma4_tensors(t, n_vocab: int) -> None:
    """Every tensor of a gemma4 model after token_embd and output_norm (t: synthetic_gguf's _Tensors)."""
    p = t.p
    t.table("rope_freqs.weight", rope_divisors(p.head_dim))
    n_pl = p.n_embd_per_layer
    if n_pl:
        t.matrix("per_layer_token_embd.weight", n_vocab, n_pl * p.n_layer, 1.0 / np.sqrt(n_pl))
        t.matrix("per_layer_model_proj.weight", n_pl * p.n_layer, p.n_embd, 1.0 / np.sqrt(p.n_embd))
        t.vector("per_layer_proj_norm.weight", n_pl, 1.0, 0.1)
    sliding = p.sliding()
    n_own = p.n_layer - p.n_kv_shared
    for il in range(p.n_layer):
        _add_layer(t, f"blk.{il}.", sliding[il], owns_kv=il < n_own)


def _add_layer(t, b: str, sliding: bool, owns_kv: bool) -> None:
    p = t.p
    head = (p.head_dim_swa or p.head_dim) if sliding else p.head_dim
    n_kv = (p.n_head_kv_swa or p.n_head_kv) if sliding else p.n_head_kv
    q_dim, kv_dim, in_std = p.n_head * head, n_kv * head, 1.0 / np.sqrt(p.n_embd)
    t.vector(b + "attn_norm.weight", p.n_embd, 1.0, 0.1)
    t.matrix(b + "attn_q.weight", q_dim, p.n_embd, in_std)
    if owns_kv:
        t.matrix(b + "attn_k.weight", kv_dim, p.n_embd, in_std)
        if sliding or not p.k_eq_v:
            t.matrix(b + "attn_v.weight", kv_dim, p.n_embd, in_std)
    t.matrix(b + "attn_output.weight", p.n_embd, q_dim, 1.0 / np.sqrt(q_dim))
    t.vector(b + "attn_q_norm.weight", head, 0.3, 0.03)
    if owns_kv:
        t.vector(b + "attn_k_norm.weight", head, 0.3, 0.03)
    t.vector(b + "post_attention_norm.weight", p.n_embd, 2.0, 0.2)
    t.vector(b + "ffn_norm.weight", p.n_embd, 1.0, 0.1)
    t.matrix(b + "ffn_gate.weight", p.n_ff, p.n_embd, in_std)
    t.matrix(b + "ffn_up.weight", p.n_ff, p.n_embd, in_std)
    t.matrix(b + "ffn_down.weight", p.n_embd, p.n_ff, 1.0 / np.sqrt(p.n_ff))
    t.vector(b + "post_ffw_norm.weight", p.n_embd, 2.0, 0.2)
    if p.n_expert:
        t.float_matrix(b + "ffn_gate_inp.weight", p.n_expert, p.n_embd, 6.0 / np.sqrt(p.n_embd))
        for name in ("ffn_gate_inp.scale", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight", "post_ffw_norm_2.weight"):
            t.vector(b + name, p.n_embd, 1.0, 0.1)
        t.matrix(b + "ffn_gate_up_exps.weight", 2 * p.n_ff_exp, p.n_embd, in_std, p.n_expert)
        t.matrix(b + "ffn_down_exps.weight", p.n_embd, p.n_ff_exp, 1.0 / np.sqrt(p.n_ff_exp), p.n_expert)
        t.vector(b + "ffn_down_exps.scale", p.n_expert, 1.0, 0.1)
    if p.n_embd_per_layer:
        t.matrix(b + "inp_gate.weight", p.n_embd_per_layer, p.n_embd, in_std)
        t.matrix(b + "proj.weight", p.n_embd, p.n_embd_per_layer, 1.0 / np.sqrt(p.n_embd_per_layer))
        t.vector(b + "post_norm.weight", p.n_embd, 1.0, 0.1)
    t.vector(b + "layer_output_scale.weight", 1, 0.9, 0.05)
