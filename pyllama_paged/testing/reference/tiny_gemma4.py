"""Write tiny ``gemma4`` GGUF models with random weights, laid out as llama.cpp's converter
writes Gemma 4 (conversion/gemma.py's Gemma4Model): its tensor names, GGML shapes and metadata
keys, the "proportional" rope of the full layers as ``rope_freqs.weight`` (divisor 1 for the
rotated pairs, 1e30 for the rest), norm weights as the multipliers applied (Gemma 4's converter
adds nothing to them), a Gemma vocabulary with Gemma 4's markup tokens.

Two shapes, each a Gemma 4 in miniature:

* ``dense`` (E2B/E4B): sliding layers of head size 64 and full ones of 128 (E4B: 256 and 512),
  more query than KV heads, per-layer embeddings, the last two layers reading the KV of the
  last earlier layer of their kind (``shared_kv_layers``), their FFN twice as wide
  (``use_double_wide_mlp``, a per-layer ``feed_forward_length``), a ``layer_output_scale`` per
  layer and the final logit soft-cap.
* ``moe`` (26B-A4B): a sliding layer with four KV heads and a V projection, then a full one
  with one KV head and none (``attention_k_eq_v``: K stands in for V), a per-layer
  ``head_count_kv``, a dense FFN beside routed experts (router with its scale, the experts'
  gate and up fused in ``ffn_gate_up_exps`` as the converter writes them, or apart, and a
  per-expert output scale ``ffn_down_exps.scale``).

The window is short (8) so that tests with a few dozen tokens cross it. Weight scales keep
activations O(1): q and k norms near 0.3 keep the unscaled attention scores about a unit wide
(QK_NORM), output scales near 1 (0.8 to 1), and router logits are spread so that top-k choices
are rarely near ties. The MoE shape has two layers: each one more adds its rounding to the
router's input, and the tokens routed at a near-tie (testing/routed_logits.py) with it.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import gguf
import numpy as np

from ..vocab_metadata import add_tokenizer
from .tiny_gguf import build_vocab, quantize_tensor, resolve_type

ARCH = "gemma4"
# Gemma 4's markup: the turn markers are control tokens; the converter makes the channel,
# tool-call, tool-response and string-quote tokens user-defined so that they are rendered
CONTROL_PIECES = ("<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|think|>")
USER_DEFINED_PIECES = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                       "<tool_response|>", '<|"|>')
END_OF_TURN = "<turn|>"
# full layers rotate a quarter of their pairs (the converter's partial_rotary_factor)
PARTIAL_ROTARY_FULL = 0.25
UNROTATED_DIVISOR = 1e30
# q and k norms: unscaled scores of std ~0.7-1 (head sizes 64 and 128). Sharper softmaxes
# magnify what GGML's Q8_0 activations round (seen: 17% of the spread at norms of 0.5, with
# output scales down to 0.5), beyond any tolerance a Q8_0 file could be held to.
QK_NORM = 0.3

# Gemma 4's chat format, written here after its published description (the turns, the thinking
# switch <|think|> at the head of the system turn, tools declared there, a call and its result
# inside the model's turn, values in Gemma 4's notation) and what llama.cpp's parser reads:
#   <|turn>system\n<|think|>...<|tool>declaration:NAME{description:...,parameters:{...}}<tool|><turn|>
#   <|turn>user\n...<turn|>
#   <|turn>model\n<|tool_call>call:NAME{...}<tool_call|><|tool_response>response:NAME{...}<tool_response|>...<turn|>
# An answer's thinking (before <channel|>) is not rendered back. After a tool's result the model
# goes on in the same turn, so the generation prompt then opens no new one.
GEMMA4_TEMPLATE = (
    "{%- macro value(v) -%}"
    "{%- if v is mapping -%}{{- '{' -}}{%- for k in v -%}{{- k + ':' -}}{{- value(v[k]) -}}"
    "{%- if not loop.last -%}{{- ',' -}}{%- endif -%}{%- endfor -%}{{- '}' -}}"
    "{%- elif v is string -%}{{- '<|\"|>' + v + '<|\"|>' -}}"
    "{%- elif v is sameas true -%}{{- 'true' -}}{%- elif v is sameas false -%}{{- 'false' -}}"
    "{%- elif v is none -%}{{- 'null' -}}"
    "{%- elif v is iterable -%}{{- '[' -}}{%- for x in v -%}{{- value(x) -}}"
    "{%- if not loop.last -%}{{- ',' -}}{%- endif -%}{%- endfor -%}{{- ']' -}}"
    "{%- else -%}{{- v -}}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- set ns = namespace(first=0, open=false, calls=[], answered=0) -%}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- if thinking or tools or (messages and messages[0]['role'] == 'system') -%}"
    "{{- '<|turn>system\n' -}}{%- if thinking -%}{{- '<|think|>' -}}{%- endif -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] | trim -}}{%- set ns.first = 1 -%}{%- endif -%}"
    "{%- for tool in tools or [] -%}{%- set f = tool['function'] -%}"
    "{{- '<|tool>declaration:' + f['name'] -}}"
    "{{- value({'description': f['description'] or '', 'parameters': f['parameters'] or {}}) -}}{{- '<tool|>' -}}"
    "{%- endfor -%}"
    "{{- '<turn|>\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages[ns.first:] -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{%- set name = m.get('name') or (ns.calls[ns.answered] if ns.answered < ns.calls | length else 'tool') -%}"
    "{%- set ns.answered = ns.answered + 1 -%}"
    "{{- '<|tool_response>response:' + name -}}{{- value({'value': m['content']}) -}}{{- '<tool_response|>' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if not ns.open -%}{{- '<|turn>model\n' -}}{%- endif -%}"
    "{{- (m['content'] or '').split('<channel|>')[-1] | trim -}}"
    "{%- set ns.calls = [] -%}{%- set ns.answered = 0 -%}"
    "{%- for call in m.get('tool_calls') or [] -%}{%- set f = call['function'] -%}"
    "{{- '<|tool_call>call:' + f['name'] -}}{{- value(f['arguments']) -}}{{- '<tool_call|>' -}}"
    "{%- set ns.calls = ns.calls + [f['name']] -%}"
    "{%- endfor -%}"
    "{%- if ns.calls -%}{%- set ns.open = true -%}{%- else -%}{{- '<turn|>\n' -}}{%- set ns.open = false -%}{%- endif -%}"
    "{%- else -%}"
    "{%- if ns.open -%}{{- '<turn|>\n' -}}{%- set ns.open = false -%}{%- endif -%}"
    "{{- '<|turn>' + m['role'] + '\n' + (m['content'] | trim) + '<turn|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and not ns.open -%}{{- '<|turn>model\n' -}}{%- endif -%}"
)

SHAPES = {
    "dense": dict(n_layer=8, sliding=(True, True, False, True, True, False, True, False), n_kv_shared=2,
                  n_embd=256, n_head=4, n_head_kv=(1,), head_dim=128, head_dim_swa=64, n_ff=512,
                  double_wide=True, n_embd_per_layer=32, n_expert=0, n_expert_used=0, n_ff_exp=0,
                  v_on_full=True),
    "moe": dict(n_layer=2, sliding=(True, False), n_kv_shared=0, n_embd=256, n_head=8,
                n_head_kv=(4, 1), head_dim=128, head_dim_swa=64, n_ff=256, double_wide=False,
                n_embd_per_layer=0, n_expert=8, n_expert_used=2, n_ff_exp=256, v_on_full=False),
}


def gemma4_vocab(n_vocab: int | None = None) -> dict:
    """The tiny Gemma vocabulary (tiny_gguf.build_vocab, with newline runs as Gemma 4's has them)
    with Gemma 4's markup tokens typed as its GGUF types them; BOS added, no space prefix; and
    merges that build every piece from the piece one character shorter (the ranks Gemma 4's
    tokenizer reads: tokenizer_gemma4_bpe)."""
    vocab = build_vocab("gemma3", n_vocab, ["\n", "\n\n"])
    for pieces, ttype in ((CONTROL_PIECES, gguf.TokenType.CONTROL), (USER_DEFINED_PIECES, gguf.TokenType.USER_DEFINED)):
        for piece in pieces:
            # in place of <unusedN> padding where the vocabulary was padded, else appended
            slot = next((i for i, t in enumerate(vocab["tokens"]) if t.startswith("<unused")), None)
            if slot is None:
                vocab["tokens"].append(piece), vocab["types"].append(int(ttype)), vocab["scores"].append(0.0)
            else:
                vocab["tokens"][slot], vocab["types"][slot] = piece, int(ttype)
    known = set(vocab["tokens"])
    merges = [f"{t[:-1]} {t[-1]}" for t, ttype in zip(vocab["tokens"], vocab["types"])
              if ttype == gguf.TokenType.NORMAL and len(t) > 1 and t[:-1] in known and t[-1] in known]
    return {**vocab, "merges": merges, "add_bos": True, "add_eos": False, "add_space_prefix": False}


def rope_divisors(head_dim: int) -> np.ndarray:
    """rope_freqs.weight for full layers of head_dim: the rotated quarter of the pairs at
    divisor 1, the rest at 1e30 (an angle of zero)."""
    n_pairs = head_dim // 2
    n_rot = int(head_dim * PARTIAL_ROTARY_FULL / 2)
    return np.array([1.0] * n_rot + [UNROTATED_DIVISOR] * (n_pairs - n_rot), dtype=np.float32)


def write_tiny_gemma4(
    path: str | os.PathLike,
    shape: str = "dense",
    *,
    weight_type: str = "q8_0",
    fused_experts: bool = True,
    sliding_window: int = 8,
    final_logit_softcapping: float | None = 30.0,
    v_on_full: bool | None = None,
    chat_template: str | None = GEMMA4_TEMPLATE,
    tokenizer: str = "gemma4",
    n_vocab: int | None = None,
    vocab: dict | None = None,
    tie_embeddings: bool = True,
    context_length: int = 4096,
    seed: int = 0,
    name: str | None = None,
    tensor_hook: Callable[[str, np.ndarray], np.ndarray] | None = None,
    drop: Sequence[str] = (),
) -> str:
    """Write a tiny random gemma4 GGUF of one of SHAPES to ``path`` and return the path.

    ``weight_type``: every matrix's type (tiny_gguf's, with its fallbacks for short rows);
    norms, scales, the router and rope_freqs stay f32. ``fused_experts``: the experts' gate and
    up as one ``ffn_gate_up_exps`` (else ``ffn_gate_exps`` and ``ffn_up_exps``). ``v_on_full``:
    whether full layers have a V projection (default: the shape's; sliding ones always do).
    ``tokenizer``: "gemma4" (Gemma 4's, as its files have it) or "llama" (the same pieces as a
    SentencePiece vocabulary). ``vocab``: the vocabulary to write instead of gemma4_vocab's
    (tiny_gguf.build_vocab's dict with its add_* flags; with tokenizer "llama"), e.g. a scripted
    model's; ``tie_embeddings=False`` writes an ``output.weight`` head of its own.
    ``tensor_hook(name, data)`` returns what to write instead of a tensor's drawn data (same
    shape, before quantization); tensors named in ``drop`` are not written."""
    s = SHAPES[shape]
    n_layer, sliding = s["n_layer"], list(s["sliding"])
    n_head_kv = list(s["n_head_kv"]) * (n_layer if len(s["n_head_kv"]) == 1 else 1)
    n_own = n_layer - s["n_kv_shared"]
    n_ff = [s["n_ff"] * (2 if s["double_wide"] and il >= n_own else 1) for il in range(n_layer)]
    vocab = gemma4_vocab(n_vocab) if vocab is None else dict(vocab)
    if chat_template:
        vocab["chat_template"] = chat_template
    n_vocab = len(vocab["tokens"])
    rng = np.random.default_rng(seed)

    w = gguf.GGUFWriter(os.fspath(path), ARCH)
    w.add_type("model")
    w.add_name(name or f"tiny-gemma4-{shape}")
    _add_hparams(w, s, n_layer, sliding, n_head_kv, n_ff, sliding_window, final_logit_softcapping, context_length)
    if tokenizer == "gemma4":   # Gemma 4's own (merge ranks over SentencePiece-style pieces)
        add_tokenizer(w, "gemma4", "gemma4", vocab)
    else:   # the same pieces read as a SentencePiece vocabulary ("llama"), merged by score
        add_tokenizer(w, "llama", "default", {**vocab, "merges": None})
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def add(tname: str, data: np.ndarray, wtype: str | None = None) -> None:
        if tname in drop:
            return
        if tensor_hook is not None:
            out = np.asarray(tensor_hook(tname, data), dtype=np.float32)
            if out.shape != data.shape:
                raise ValueError(f"tensor_hook changed {tname}'s shape from {data.shape} to {out.shape}")
            data = out
        if wtype is None:
            w.add_tensor(tname, np.ascontiguousarray(data, dtype=np.float32))
        else:
            arr, qt = quantize_tensor(data, resolve_type(wtype, data.shape[-1]))
            w.add_tensor(tname, arr, raw_dtype=qt)

    def matrix(tname: str, shape_: tuple[int, ...], std: float, wtype: str | None = weight_type) -> None:
        # numpy shape (..., n_out, n_in) == GGML ne [n_in, n_out, ...]
        add(tname, rng.standard_normal(shape_, dtype=np.float32) * np.float32(std), wtype)

    def vector(tname: str, n: int, centre: float, spread: float = 0.1) -> None:
        add(tname, (centre + spread * rng.standard_normal(n)).astype(np.float32))

    n_embd, n_pl = s["n_embd"], s["n_embd_per_layer"]
    matrix("token_embd.weight", (n_vocab, n_embd), 0.5 / np.sqrt(n_embd))
    if not tie_embeddings:
        matrix("output.weight", (n_vocab, n_embd), 0.5 / np.sqrt(n_embd))
    vector("output_norm.weight", n_embd, 4.0)
    add("rope_freqs.weight", rope_divisors(s["head_dim"]))
    if n_pl:
        matrix("per_layer_token_embd.weight", (n_vocab, n_pl * n_layer), 1.0 / np.sqrt(n_pl))
        matrix("per_layer_model_proj.weight", (n_pl * n_layer, n_embd), 1.0 / np.sqrt(n_embd))
        vector("per_layer_proj_norm.weight", n_pl, 1.0)
    for il in range(n_layer):
        head_dim = s["head_dim_swa"] if sliding[il] else s["head_dim"]
        _add_layer(matrix, vector, s, f"blk.{il}.", head_dim, n_head_kv[il], n_ff[il],
                   owns_kv=il < n_own, has_v=sliding[il] or (s["v_on_full"] if v_on_full is None else v_on_full),
                   fused=fused_experts, rng=rng, add=add)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def _add_hparams(w, s: dict, n_layer: int, sliding: list[bool], n_head_kv: list[int], n_ff: list[int],
                 window: int, softcap: float | None, context_length: int) -> None:
    """The metadata keys Gemma 4's converter writes, in its order."""
    w.add_context_length(context_length)
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff if len(set(n_ff)) > 1 else n_ff[0])
    w.add_head_count(s["n_head"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_freq_base_swa(10_000.0)
    if softcap is not None:
        w.add_final_logit_softcapping(float(softcap))
    w.add_sliding_window(int(window))
    w.add_head_count_kv(n_head_kv if len(set(n_head_kv)) > 1 else n_head_kv[0])
    w.add_shared_kv_layers(s["n_kv_shared"])
    w.add_embedding_length_per_layer_input(s["n_embd_per_layer"])
    w.add_sliding_window_pattern(sliding)
    w.add_key_length_swa(s["head_dim_swa"])
    w.add_value_length_swa(s["head_dim_swa"])
    if s["n_expert"]:
        w.add_expert_count(s["n_expert"])
        w.add_expert_used_count(s["n_expert_used"])
        w.add_expert_feed_forward_length(s["n_ff_exp"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_dimension_count_swa(s["head_dim_swa"])


def _add_layer(matrix, vector, s: dict, p: str, head_dim: int, n_head_kv: int, n_ff: int, *, owns_kv: bool,
               has_v: bool, fused: bool, rng: np.random.Generator, add) -> None:
    """One layer's tensors: attention (K/V only where the layer computes its own), the dense FFN,
    the experts beside it for a MoE shape, the per-layer embedding's, the output scale."""
    n_embd, n_head = s["n_embd"], s["n_head"]
    q_dim, kv_dim, std = n_head * head_dim, n_head_kv * head_dim, 1.0 / np.sqrt(n_embd)
    vector(p + "attn_norm.weight", n_embd, 1.0)
    matrix(p + "attn_q.weight", (q_dim, n_embd), std)
    if owns_kv:
        matrix(p + "attn_k.weight", (kv_dim, n_embd), std)
        if has_v:
            matrix(p + "attn_v.weight", (kv_dim, n_embd), std)
    matrix(p + "attn_output.weight", (n_embd, q_dim), 1.0 / np.sqrt(q_dim))
    vector(p + "attn_q_norm.weight", head_dim, QK_NORM, 0.1 * QK_NORM)
    if owns_kv:
        vector(p + "attn_k_norm.weight", head_dim, QK_NORM, 0.1 * QK_NORM)
    vector(p + "post_attention_norm.weight", n_embd, 2.0)
    vector(p + "ffn_norm.weight", n_embd, 1.0)
    matrix(p + "ffn_gate.weight", (n_ff, n_embd), std)
    matrix(p + "ffn_up.weight", (n_ff, n_embd), std)
    matrix(p + "ffn_down.weight", (n_embd, n_ff), 1.0 / np.sqrt(n_ff))
    vector(p + "post_ffw_norm.weight", n_embd, 2.0)
    if s["n_expert"]:
        n_expert, n_ff_exp = s["n_expert"], s["n_ff_exp"]
        # the router's input is rmsnorm(h) / sqrt(n_embd) * scale: a weight of std 6 spreads its
        # logits ~6 wide, which keeps the top experts apart (see the module docstring)
        matrix(p + "ffn_gate_inp.weight", (n_expert, n_embd), 6.0, wtype=None)
        vector(p + "ffn_gate_inp.scale", n_embd, 1.0)
        vector(p + "pre_ffw_norm_2.weight", n_embd, 1.0)
        vector(p + "post_ffw_norm_1.weight", n_embd, 1.0)
        vector(p + "post_ffw_norm_2.weight", n_embd, 1.0)
        if fused:
            matrix(p + "ffn_gate_up_exps.weight", (n_expert, 2 * n_ff_exp, n_embd), std)
        else:
            matrix(p + "ffn_gate_exps.weight", (n_expert, n_ff_exp, n_embd), std)
            matrix(p + "ffn_up_exps.weight", (n_expert, n_ff_exp, n_embd), std)
        matrix(p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff_exp), 1.0 / np.sqrt(n_ff_exp))
        vector(p + "ffn_down_exps.scale", n_expert, 1.0, 0.3)
    if s["n_embd_per_layer"]:
        n_pl = s["n_embd_per_layer"]
        matrix(p + "inp_gate.weight", (n_pl, n_embd), std)
        matrix(p + "proj.weight", (n_embd, n_pl), 1.0 / np.sqrt(n_pl))
        vector(p + "post_norm.weight", n_embd, 1.0)
    add(p + "layer_output_scale.weight", rng.uniform(0.8, 1.0, 1).astype(np.float32))
