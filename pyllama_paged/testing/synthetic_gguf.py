"""A random-weight Gemma 3 GGUF the size of a real 1-3B model, quantized like Q4_K_M,
for benchmarks where weight and KV bytes must be realistic (issue 13's GPU runs, CPU
runs on a model larger than the embedded 270M).

The architecture, metadata and tokenizer are the embedded default model's (so prompts
tokenize as in chat and llama.cpp loads the file); the shapes are chosen here. Weights
are random quantized blocks written directly (no float weights are ever made, so a
1.6B model takes seconds): random 4- and 6-bit values under one scale per tensor,
centred, with the standard deviation a trained model's layers have. Q4_K for every
matrix, Q6_K for the tied embedding/output head and for attn_v and ffn_down in the
layers llama.cpp's Q4_K_M gives more bits.

    python -m pyllama_paged.testing.synthetic_gguf [--out bench/.models/gemma3-synthetic-1.6b-q4_k_m.gguf]
        [--n-embd 2048] [--n-layer 18] [--n-head 8] [--n-head-kv 4] [--n-ff 8192] [--seed 0]

--out is relative to the working directory (a source checkout's root, run as `python -P -m ...`
there so that the source tree, which has no native library, does not shadow the installed package).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from .synthetic_blocks import QK_K, q4_k_blocks, q6_k_blocks


def more_bits(layer: int, n_layer: int) -> bool:
    """The layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K (llama.cpp's rule)."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def write(out: Path, n_embd: int = 2048, n_layer: int = 18, n_head: int = 8, n_head_kv: int = 4,
          n_ff: int = 8192, head_dim: int = 256, seed: int = 0, source: str | None = None) -> dict:
    """Write the model to out; returns its shape and parameter count."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    from pyllama_paged.engine.model import default_model_path

    for name, v in (("n_embd", n_embd), ("n_ff", n_ff), ("n_head * head_dim", n_head * head_dim)):
        if v % QK_K:
            raise ValueError(f"{name} = {v} must be a multiple of {QK_K} for K-quant rows")
    reader = gguf.GGUFReader(source or default_model_path())
    fields = reader.fields
    if fields["general.architecture"].contents() != "gemma3":
        raise ValueError("the source model must be a gemma3 GGUF (its tokenizer and metadata are reused)")
    rng = np.random.default_rng(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), "gemma3")
    n_params = 0
    w.add_name(f"Gemma 3 synthetic (random weights) {n_embd}x{n_layer}")
    w.add_context_length(int(fields["gemma3.context_length"].contents()))
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(float(fields["gemma3.attention.layer_norm_rms_epsilon"].contents()))
    w.add_rope_freq_base(float(fields["gemma3.rope.freq_base"].contents()))
    w.add_sliding_window(int(fields["gemma3.attention.sliding_window"].contents()))
    tokens = fields["tokenizer.ggml.tokens"].contents()
    w.add_tokenizer_model(fields["tokenizer.ggml.model"].contents())
    w.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
    w.add_token_list(tokens)
    w.add_token_scores(fields["tokenizer.ggml.scores"].contents())
    w.add_token_types(fields["tokenizer.ggml.token_type"].contents())
    w.add_bos_token_id(int(fields["tokenizer.ggml.bos_token_id"].contents()))
    w.add_eos_token_id(int(fields["tokenizer.ggml.eos_token_id"].contents()))
    w.add_unk_token_id(int(fields["tokenizer.ggml.unknown_token_id"].contents()))
    w.add_pad_token_id(int(fields["tokenizer.ggml.padding_token_id"].contents()))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    if "tokenizer.chat_template" in fields:
        w.add_chat_template(fields["tokenizer.chat_template"].contents())
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))

    def matrix(name: str, n_out: int, n_in: int, std: float, q6: bool = False) -> None:
        nonlocal n_params
        blocks = (q6_k_blocks if q6 else q4_k_blocks)(rng, n_out, n_in, std)
        w.add_tensor(name, blocks, raw_dtype=QT.Q6_K if q6 else QT.Q4_K)
        n_params += n_out * n_in

    def norm(name: str, n: int, centre: float = 1.0) -> None:
        nonlocal n_params
        # gemma's norms are stored as the multiplier applied (HF's 1 + w, baked in by the converter)
        w.add_tensor(name, (centre * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32))
        n_params += n

    n_vocab = len(tokens)
    # The scales of pyllama_paged/testing/reference/tiny_gguf.py's gemma3: small embeddings (gemma multiplies
    # them by sqrt(n_embd) and ties the head), output_norm ~4, post-norms ~2.
    matrix("token_embd.weight", n_vocab, n_embd, 0.5 / np.sqrt(n_embd), q6=True)
    norm("output_norm.weight", n_embd, 4.0)
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    for il in range(n_layer):
        p = f"blk.{il}."
        norm(p + "attn_norm.weight", n_embd)
        matrix(p + "attn_q.weight", q_dim, n_embd, 1.0 / np.sqrt(n_embd))
        matrix(p + "attn_k.weight", kv_dim, n_embd, 1.0 / np.sqrt(n_embd))
        matrix(p + "attn_v.weight", kv_dim, n_embd, 1.0 / np.sqrt(n_embd), q6=more_bits(il, n_layer))
        norm(p + "attn_q_norm.weight", head_dim)
        norm(p + "attn_k_norm.weight", head_dim)
        matrix(p + "attn_output.weight", n_embd, q_dim, 1.0 / np.sqrt(q_dim))
        norm(p + "post_attention_norm.weight", n_embd, 2.0)
        norm(p + "ffn_norm.weight", n_embd)
        matrix(p + "ffn_gate.weight", n_ff, n_embd, 1.0 / np.sqrt(n_embd))
        matrix(p + "ffn_up.weight", n_ff, n_embd, 1.0 / np.sqrt(n_embd))
        matrix(p + "ffn_down.weight", n_embd, n_ff, 1.0 / np.sqrt(n_ff), q6=more_bits(il, n_layer))
        norm(p + "post_ffw_norm.weight", n_embd, 2.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"path": str(out), "n_embd": n_embd, "n_layer": n_layer, "n_head": n_head, "n_head_kv": n_head_kv,
            "n_ff": n_ff, "head_dim": head_dim, "n_vocab": n_vocab, "n_params": n_params,
            "bytes": out.stat().st_size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path("bench") / ".models" / "gemma3-synthetic-1.6b-q4_k_m.gguf"))
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-layer", type=int, default=18)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--n-head-kv", type=int, default=4)
    ap.add_argument("--n-ff", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    info = write(Path(args.out), args.n_embd, args.n_layer, args.n_head, args.n_head_kv, args.n_ff, seed=args.seed)
    print(f"{info['path']}: {info['n_params'] / 1e9:.2f}B parameters, {info['bytes'] / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
