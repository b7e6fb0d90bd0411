"""The float64 reference of ``gemma4`` (Gemma 4 E2B/E4B, 12B, 26B-A4B, 31B text models), as
llama.cpp's graph (src/models/gemma4.cpp at 0c1e570) computes it from a GGUF.
``Gemma4Reference.from_gguf`` loads one (``loader.load_reference`` any supported file); its
``forward`` has ``ReferenceModel.forward``'s contract (past_kv / return_kv included).

What differs from gemma3 (numpy_model.py's docstring has the shared rules):

* Layers: ``attention.sliding_window_pattern`` (one bool per layer, True = sliding) says which
  layers slide over ``attention.sliding_window``; the others attend over every key.
* Head sizes and rope per kind of layer: full layers have ``attention.key_length`` and
  ``rope.dimension_count``, sliding ones ``attention.key_length_swa`` and
  ``rope.dimension_count_swa``; ``attention.head_count_kv`` may be one count per layer. Full
  layers rotate with ``rope.freq_base`` (and a linear ``rope.scaling.factor``), sliding ones with
  ``rope.freq_base_swa`` (default 10000), unscaled. ``rope_freqs.weight`` (the converter's
  "proportional" rope: divisors of 1 for the rotated pairs and 1e30 for the rest) divides the
  full layers' frequencies only. NEOX layout.
* Attention: q and k get their per-head RMSNorm (``attn_q_norm``, ``attn_k_norm``) before rope,
  v an RMSNorm without weight; the softmax scale is 1. A layer without ``attn_v`` uses its k
  projection (before the k norm) as v.
* Shared KV: with ``attention.shared_kv_layers`` = n, the last n layers compute no K/V: each
  attends over the KV of the last earlier layer of its own kind (llama.cpp: the layer before
  the first shared one for a full layer, the one before that for a sliding one, which is the
  same for every Gemma 4).
* Per-layer embeddings (``embedding_length_per_layer_input`` = n_pl > 0, E2B/E4B): the
  inputs of every layer at once are ``(rmsnorm(per_layer_model_proj x0 / sqrt(n_embd)) *
  per_layer_proj_norm + per_layer_token_embd[token] * sqrt(n_pl)) / sqrt(2)``, x0 the scaled
  token embedding, viewed as [n_layer, n_pl]; after its FFN, layer il adds
  ``rmsnorm(proj (gelu(inp_gate x) * input_il)) * post_norm`` to the residual stream.
* FFN: GELU-gated (tanh form) as gemma3, with ``post_ffw_norm`` on its output. A layer with a
  router (``ffn_gate_inp``, 26B-A4B) runs its dense FFN (then ``post_ffw_norm_1``) beside the
  experts: their input is ``pre_ffw_norm_2(h)``, the router's ``rmsnorm(h) / sqrt(n_embd) *
  ffn_gate_inp.scale`` (h the residual after attention); softmax over all experts, the top
  ``expert_used_count`` renormalised, GELU-gated experts (``ffn_gate_up_exps``: gate rows then
  up rows; or ``ffn_gate_exps`` and ``ffn_up_exps``), each expert's output times
  ``ffn_down_exps.scale[e]`` when present, the sum through ``post_ffw_norm_2``; the two sums
  are added before ``post_ffw_norm``.
* ``layer_output_scale`` (one value per layer) multiplies the residual stream after the layer.
* Logits: the tied (or ``output.weight``) head, then ``final_logit_softcapping``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .numpy_model import (LayerInfo, ReferenceModel, attention, gelu_tanh, load_tensor, arch_fields, read_gguf,
                          rms_norm, rope, router_margin, routed_experts)

# llama.cpp's hparams default for the sliding layers' rope base when the file has none
ROPE_FREQ_BASE_SWA = 10000.0


@dataclass
class Gemma4Layer(LayerInfo):
    """A gemma4 layer's own shapes, and whose KV it attends over."""

    head_dim: int = 0
    n_head_kv: int = 0
    n_rot: int = 0
    n_ff: int = 0
    kv_source: int = -1   # the layer whose K/V it reads (itself when it computes its own)


def per_layer(value, n_layer: int, what: str) -> list[int]:
    """A metadata value given once or per layer, as one entry per layer."""
    if isinstance(value, (list, tuple)):
        if len(value) < n_layer:
            raise ValueError(f"{what}: {len(value)} entries for {n_layer} layers")
        return [int(v) for v in value[:n_layer]]
    return [int(value)] * n_layer


def kv_sources(sliding: Sequence[bool], n_shared: int) -> list[int]:
    """For each layer, the layer whose KV it uses: itself, or for the last n_shared layers the
    last earlier layer of the same kind that computes its own."""
    n_own = len(sliding) - n_shared
    out = list(range(n_own))
    for il in range(n_own, len(sliding)):
        same = [j for j in range(n_own) if sliding[j] == sliding[il]]
        if not same:
            raise ValueError(f"shared-KV layer {il} has no earlier layer of its kind to read")
        out.append(same[-1])
    return out


def _layers(hp, n_layer: int) -> list[Gemma4Layer]:
    """Every layer's kind, shapes, rope and KV source from the metadata (hp reads a key)."""
    sliding = [bool(b) for b in hp("attention.sliding_window_pattern")][:n_layer]
    head_full = int(hp("attention.key_length"))
    head_swa = int(hp("attention.key_length_swa", head_full))
    if int(hp("attention.value_length", head_full)) != head_full or \
            int(hp("attention.value_length_swa", head_swa)) != head_swa:
        raise ValueError("gemma4 needs value_length == key_length for both kinds of layer")
    rot_full = int(hp("rope.dimension_count", head_full))
    rot_swa = int(hp("rope.dimension_count_swa", rot_full))
    base, base_swa = float(hp("rope.freq_base", 10000.0)), float(hp("rope.freq_base_swa", ROPE_FREQ_BASE_SWA))
    factor = hp("rope.scaling.factor", None)
    scale = 1.0 / float(factor) if factor not in (None, 0, 0.0) and hp("rope.scaling.type", "linear") != "none" \
        else 1.0
    n_head = int(hp("attention.head_count"))
    n_head_kv = per_layer(hp("attention.head_count_kv", n_head), n_layer, "head_count_kv")
    n_ff = per_layer(hp("feed_forward_length"), n_layer, "feed_forward_length")
    source = kv_sources(sliding, int(hp("attention.shared_kv_layers", 0)))
    return [Gemma4Layer(s, base_swa if s else base, 1.0 if s else scale, head_dim=head_swa if s else head_full,
                        n_head_kv=n_head_kv[il], n_rot=rot_swa if s else rot_full, n_ff=n_ff[il],
                        kv_source=source[il])
            for il, s in enumerate(sliding)]


@dataclass
class Gemma4Reference(ReferenceModel):
    """ReferenceModel's interface over gemma4's graph (see the module docstring)."""

    n_embd_per_layer: int = 0

    @classmethod
    def from_gguf(cls, path) -> "Gemma4Reference":
        """The reference of a gemma4 GGUF file."""
        return cls.from_file_parts(*read_gguf(path))

    @classmethod
    def from_file_parts(cls, meta: dict[str, Any], infos, mm) -> "Gemma4Reference":
        """The reference of a gemma4 file that read_gguf parsed."""
        hp = arch_fields(meta, "gemma4")
        tensors = {info.name: load_tensor(mm, info) for info in infos}
        n_layer, n_embd = int(hp("block_count")), int(hp("embedding_length"))
        layers = _layers(hp, n_layer)
        softcap = hp("final_logit_softcapping", None)
        full = next((layer for layer in layers if not layer.sliding), layers[0])
        return cls(
            arch="gemma4", tensors=tensors, metadata=meta, n_layer=n_layer, n_embd=n_embd,
            n_vocab=tensors["token_embd.weight"].shape[0], n_ff=max(layer.n_ff for layer in layers),
            n_expert=int(hp("expert_count", 0)), n_expert_used=int(hp("expert_used_count", 0)),
            n_head=int(hp("attention.head_count")), n_head_kv=full.n_head_kv, head_dim=full.head_dim,
            head_dim_v=full.head_dim, n_rot=full.n_rot, rms_eps=float(hp("attention.layer_norm_rms_epsilon")),
            context_length=int(hp("context_length", 0)), sliding_window=int(hp("attention.sliding_window")),
            attn_scale=1.0, final_logit_softcap=float(softcap) if softcap and float(softcap) > 0 else None,
            layers=layers, tokens=list(meta.get("tokenizer.ggml.tokens", [])),
            bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            n_embd_per_layer=int(hp("embedding_length_per_layer_input")))

    # ----------------------------------------------------------------- pieces

    def per_layer_inputs(self, ids: np.ndarray, x0: np.ndarray) -> np.ndarray | None:
        """[n_tokens, n_layer, n_pl]: every layer's per-layer input (None without them)."""
        n_pl = self.n_embd_per_layer
        if not n_pl:
            return None
        n = len(ids)
        table = self.tensors["per_layer_token_embd.weight"][ids].astype(np.float64)
        table = table.reshape(n, self.n_layer, n_pl) * math.sqrt(n_pl)
        proj = x0 @ self.tensors["per_layer_model_proj.weight"].T.astype(np.float64) / math.sqrt(self.n_embd)
        proj = rms_norm(proj.reshape(n, self.n_layer, n_pl), self.tensors["per_layer_proj_norm.weight"], self.rms_eps)
        return (proj + table) / math.sqrt(2.0)

    def _qkv(self, il: int, h: np.ndarray, pos: np.ndarray):
        """Layer il's roped queries, and its roped keys and normed values (None, None for a
        layer that reads another's KV)."""
        p, info, n, eps = f"blk.{il}.", self.layers[il], h.shape[0], self.rms_eps
        rope_kw = dict(n_rot=info.n_rot, base=info.rope_base, freq_scale=info.rope_freq_scale, neox=True,
                       freq_factors=None if info.sliding else self._w("rope_freqs.weight"))
        q = self._linear(h, p + "attn_q").reshape(n, self.n_head, info.head_dim)
        q = rope(rms_norm(q, self.tensors[p + "attn_q_norm.weight"], eps), pos, **rope_kw)
        if info.kv_source != il:
            return q, None, None
        k = self._linear(h, p + "attn_k").reshape(n, info.n_head_kv, info.head_dim)
        v = self._linear(h, p + "attn_v").reshape(k.shape) if p + "attn_v.weight" in self.tensors else k
        k = rope(rms_norm(k, self.tensors[p + "attn_k_norm.weight"], eps), pos, **rope_kw)
        return q, k, rms_norm(v, None, eps)

    def _dense_ffn(self, h: np.ndarray, p: str) -> np.ndarray:
        return self._linear(gelu_tanh(self._linear(h, p + "ffn_gate")) * self._linear(h, p + "ffn_up"), p + "ffn_down")

    def _ffn(self, p: str, h: np.ndarray) -> np.ndarray:
        """The layer's FFN output (before post_ffw_norm) for h, the residual after attention."""
        eps = self.rms_eps
        dense = self._dense_ffn(rms_norm(h, self.tensors[p + "ffn_norm.weight"], eps), p)
        if p + "ffn_gate_inp.weight" not in self.tensors:
            return dense
        t = self.tensors
        router = t[p + "ffn_gate_inp.weight"]
        router_in = rms_norm(h, None, eps) / math.sqrt(self.n_embd) * t[p + "ffn_gate_inp.scale"]
        if p + "ffn_gate_up_exps.weight" in t:
            gate, up = np.split(t[p + "ffn_gate_up_exps.weight"], 2, axis=1)
        else:
            gate, up = t[p + "ffn_gate_exps.weight"], t[p + "ffn_up_exps.weight"]
        experts = routed_experts(rms_norm(h, t[p + "pre_ffw_norm_2.weight"], eps), router, gate, up,
                                 t[p + "ffn_down_exps.weight"], self.n_expert_used, act=gelu_tanh,
                                 router_input=router_in, expert_scale=t.get(p + "ffn_down_exps.scale"))
        self.last_router_margin = np.minimum(self.last_router_margin,
                                             router_margin(router_in, router, self.n_expert_used))
        return rms_norm(dense, t[p + "post_ffw_norm_1.weight"], eps) + \
            rms_norm(experts, t[p + "post_ffw_norm_2.weight"], eps)

    def _per_layer_embedding(self, p: str, x: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        """What layer p's per-layer input adds to the residual stream x."""
        g = gelu_tanh(x @ self.tensors[p + "inp_gate.weight"].T.astype(np.float64)) * inputs
        return rms_norm(g @ self.tensors[p + "proj.weight"].T.astype(np.float64), self.tensors[p + "post_norm.weight"],
                        self.rms_eps)

    # ----------------------------------------------------------------- forward

    def forward(self, token_ids: Sequence[int], *, past_kv: list[tuple[np.ndarray, np.ndarray]] | None = None,
                return_kv: bool = False):
        """Logits [n_tokens, n_vocab] (float64), as ReferenceModel.forward; a shared-KV layer's
        entry of kv is its source layer's."""
        ids = np.asarray(list(token_ids), dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0 or ids.min() < 0 or ids.max() >= self.n_vocab:
            raise ValueError("token_ids must be a non-empty 1-D sequence of ids in the vocabulary")
        n, eps = len(ids), self.rms_eps
        n_past = 0 if not past_kv else past_kv[0][0].shape[0]
        pos = np.arange(n_past, n_past + n)
        self.last_router_margin = np.full(n, np.inf)
        x = self.tensors["token_embd.weight"][ids].astype(np.float64) * math.sqrt(self.n_embd)
        inputs = self.per_layer_inputs(ids, x)
        kv: list[tuple[np.ndarray, np.ndarray]] = []
        for il, info in enumerate(self.layers):
            p = f"blk.{il}."
            q, k, v = self._qkv(il, rms_norm(x, self.tensors[p + "attn_norm.weight"], eps), pos)
            if k is None:
                k, v = kv[info.kv_source]
            elif past_kv:
                k, v = np.concatenate([past_kv[il][0], k]), np.concatenate([past_kv[il][1], v])
            kv.append((k, v))
            a = attention(q, k, v, scale=1.0, q_pos=pos, k_pos=np.arange(n_past + n),
                          window=self.sliding_window if info.sliding else None)
            o = self._linear(a.reshape(n, self.n_head * info.head_dim), p + "attn_output")
            h = x + rms_norm(o, self.tensors[p + "post_attention_norm.weight"], eps)
            x = h + rms_norm(self._ffn(p, h), self.tensors[p + "post_ffw_norm.weight"], eps)
            if inputs is not None:
                x = x + self._per_layer_embedding(p, x, inputs[:, il])
            scale = self._w(p + "layer_output_scale.weight")
            if scale is not None:
                x = x * scale
        x = rms_norm(x, self.tensors["output_norm.weight"], eps)
        self.last_hidden = x
        w_out = self.tensors.get("output.weight", self.tensors["token_embd.weight"])
        logits = self._head(x, w_out)
        if self.final_logit_softcap is not None:
            logits = self.final_logit_softcap * np.tanh(logits / self.final_logit_softcap)
        return (logits, kv) if return_kv else logits
