"""The float64 reference forward of Qwen3.5/3.6's hybrids: GGUF architectures ``qwen35``
(dense FFN) and ``qwen35moe`` (routed experts and a gated shared expert), with llama.cpp's
semantics on the same file (``src/models/qwen35.cpp``, ``qwen35moe.cpp``,
``delta-net-base.cpp``).

A layer is a Gated DeltaNet (linear attention) layer or a full-attention layer: the GGUF's
``attention.recurrent_layers`` booleans say which, else every ``full_attention_interval``-th
layer (default 4: layers 3, 7, ...) attends. ``block_count`` counts the multi-token-prediction
layers (``nextn_predict_layers``) after the trunk; they are not run.

Each layer: ``x += mixer(rms_norm(x, attn_norm))``, then
``x += ffn(rms_norm(x, post_attention_norm))``; the output head as the other decoders'.

* Full attention: ``attn_q`` gives per head a query and an output gate (``head_dim`` each, in
  that order); q and k get per-head RMS norms, then multi-section RoPE (``delta_net.imrope``,
  ``rope.dimension_sections``, the first ``rope.dimension_count`` dims rotated); softmax
  attention scaled by 1/sqrt(head_dim); the result times ``sigmoid(gate)`` goes through
  ``attn_output``.
* Gated DeltaNet: ``attn_qkv`` gives the convolution's channels (q then k, ``ssm.group_count``
  heads of ``ssm.state_size``; then v, ``ssm.time_step_rank`` heads), ``attn_gate`` the
  output gate z, ``ssm_beta`` the write strength (sigmoid), ``ssm_alpha`` with ``ssm_dt.bias``
  and ``ssm_a`` the log-decay; the causal convolution (``ssm_conv1d``, kernel
  ``ssm.conv_kernel``) and SiLU, L2-normalised q and k, the gated delta rule
  (``delta_net.delta_rule_recurrent``), an RMS norm per value head (``ssm_norm``) times
  ``silu(z)``, then ``ssm_out``.
* FFN: SwiGLU (``qwen35``); or (``qwen35moe``) qwen3moe's routed experts plus a shared expert
  (``ffn_{gate,up,down}_shexp``) scaled by ``sigmoid(ffn_gate_inp_shexp . x)``.

``forward(ids, past_kv=state, return_kv=True)`` continues a sequence from a ``HybridState``:
the full-attention layers' K/V and the linear layers' convolution and delta-rule states.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import delta_net as dn
from .numpy_model import (HYBRID_ARCHS, LayerInfo, ReferenceModel, arch_fields, attention, load_tensor, read_gguf,
                          rms_norm, routed_experts, router_margin, silu)


@dataclass(frozen=True)
class HybridShape:
    """What a hybrid adds to a decoder's shape: its layer kinds and the linear layers' sizes."""

    recurrent: tuple[bool, ...]   # per trunk layer: a Gated DeltaNet layer (else full attention)
    d_conv: int                   # ssm.conv_kernel
    d_state: int                  # ssm.state_size: each head's key and value size
    n_k_heads: int                # ssm.group_count: query/key heads
    n_v_heads: int                # ssm.time_step_rank: value heads
    rope_sections: tuple[int, int, int, int]
    n_ff_shexp: int = 0           # the shared expert's width (qwen35moe)

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.d_state

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.d_state

    @property
    def conv_channels(self) -> int:
        """The convolution's channels: q, k and v."""
        return 2 * self.key_dim + self.value_dim


def layer_kinds(meta: dict, arch: str, n_layer: int) -> tuple[bool, ...]:
    """Per trunk layer whether it is recurrent, as llama.cpp reads it: the recurrent_layers
    booleans if given, else (il + 1) % full_attention_interval != 0 (interval 4 by default)."""
    flags = meta.get(f"{arch}.attention.recurrent_layers")
    if flags is not None:
        return tuple(bool(b) for b in list(flags)[:n_layer])
    interval = int(meta.get(f"{arch}.full_attention_interval", 4))
    return tuple((il + 1) % interval != 0 for il in range(n_layer))


@dataclass
class HybridState:
    """A sequence's state after n_past tokens: per layer (K, V) [n_past, n_head_kv, head_dim] for
    full attention, (conv [d_conv - 1, channels], delta rule [H_v, S_k, S_v]) for the linear ones."""

    n_past: int
    layers: list

    def copy(self) -> "HybridState":
        """An independent copy (forward never changes the state it is given)."""
        return HybridState(self.n_past, [tuple(np.array(a, copy=True) for a in entry) for entry in self.layers])


@dataclass
class HybridReferenceModel(ReferenceModel):
    hybrid: HybridShape | None = None
    rope_base: float = 10000.0
    rope_freq_scale: float = 1.0

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "HybridReferenceModel":
        meta, infos, mm = read_gguf(path)
        arch = meta["general.architecture"]
        if arch not in HYBRID_ARCHS:
            raise ValueError(f"{arch!r} is not a hybrid architecture ({', '.join(HYBRID_ARCHS)})")
        hp = arch_fields(meta, arch)
        tensors = {info.name: load_tensor(mm, info) for info in infos}
        del mm
        n_layer = int(hp("block_count")) - int(hp("nextn_predict_layers", 0))
        n_embd, n_head = int(hp("embedding_length")), int(hp("attention.head_count"))
        head_dim = int(hp("attention.key_length", n_embd // n_head))
        n_rot = int(hp("rope.dimension_count", head_dim))
        sections = tuple(int(s) for s in list(hp("rope.dimension_sections"))[:4])
        scaling = hp("rope.scaling.type", None)
        factor = float(hp("rope.scaling.factor", 0.0) or 0.0)
        if scaling not in (None, "none", "linear") and factor not in (0.0, 1.0):
            raise NotImplementedError(f"rope scaling {scaling!r} not modelled for {arch}")
        shape = HybridShape(
            recurrent=layer_kinds(meta, arch, n_layer), d_conv=int(hp("ssm.conv_kernel")),
            d_state=int(hp("ssm.state_size")), n_k_heads=int(hp("ssm.group_count")),
            n_v_heads=int(hp("ssm.time_step_rank")), rope_sections=sections + (0,) * (4 - len(sections)),
            n_ff_shexp=int(hp("expert_shared_feed_forward_length", 0)))
        if int(hp("ssm.inner_size")) != shape.value_dim:
            raise ValueError("ssm.inner_size must be ssm.state_size * ssm.time_step_rank")
        freq_base = float(hp("rope.freq_base", 10000.0))
        freq_scale = 1.0 / factor if scaling == "linear" and factor not in (0.0, 1.0) else 1.0
        return cls(
            arch=arch, tensors=tensors, metadata=meta, n_layer=n_layer, n_embd=n_embd,
            n_vocab=tensors["token_embd.weight"].shape[0], n_ff=int(hp("feed_forward_length", 0)),
            n_expert=int(hp("expert_count", 0)), n_expert_used=int(hp("expert_used_count", 0)),
            n_head=n_head, n_head_kv=int(hp("attention.head_count_kv", n_head)), head_dim=head_dim,
            head_dim_v=int(hp("attention.value_length", head_dim)), n_rot=n_rot,
            rms_eps=float(hp("attention.layer_norm_rms_epsilon")), context_length=int(hp("context_length", 0)),
            sliding_window=None, attn_scale=1.0 / math.sqrt(head_dim), final_logit_softcap=None,
            layers=[LayerInfo(False, freq_base, freq_scale) for _ in range(n_layer)],
            tokens=list(meta.get("tokenizer.ggml.tokens", [])), bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"), hybrid=shape, rope_base=freq_base,
            rope_freq_scale=freq_scale)

    # ----------------------------------------------------------------- state

    def empty_state(self) -> HybridState:
        """A new sequence's state: no keys, zero convolution and delta-rule states."""
        sh = self.hybrid
        layers = []
        for recurrent in sh.recurrent:
            if recurrent:
                layers.append((np.zeros((sh.d_conv - 1, sh.conv_channels)),
                               np.zeros((sh.n_v_heads, sh.d_state, sh.d_state))))
            else:
                layers.append((np.zeros((0, self.n_head_kv, self.head_dim)),
                               np.zeros((0, self.n_head_kv, self.head_dim_v))))
        return HybridState(0, layers)

    # ----------------------------------------------------------------- forward

    def forward(self, token_ids: Sequence[int], *, past_kv: HybridState | None = None, return_kv: bool = False):
        """Logits [n_tokens, n_vocab] (float64) of token_ids after past_kv's tokens (none by
        default); with return_kv, (logits, the state after them). past_kv is not changed."""
        ids = np.asarray(list(token_ids), dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError("token_ids must be a non-empty 1-D sequence")
        if ids.min() < 0 or ids.max() >= self.n_vocab:
            raise ValueError("token id out of range")
        state = past_kv.copy() if past_kv is not None else self.empty_state()
        pos = np.arange(state.n_past, state.n_past + len(ids))
        self.last_router_margin = np.full(len(ids), np.inf)
        x = self.tensors["token_embd.weight"][ids].astype(np.float64)
        for il, recurrent in enumerate(self.hybrid.recurrent):
            p = f"blk.{il}."
            h = rms_norm(x, self.tensors[p + "attn_norm.weight"], self.rms_eps)
            mixer = self._linear_attention if recurrent else self._gated_attention
            out, state.layers[il] = mixer(h, p, pos, state.layers[il])
            x = x + out
            h = rms_norm(x, self.tensors[p + "post_attention_norm.weight"], self.rms_eps)
            x = x + self._ffn(h, p)
        state.n_past += len(ids)
        x = rms_norm(x, self.tensors["output_norm.weight"], self.rms_eps)
        self.last_hidden = x
        w_out = self.tensors.get("output.weight")
        logits = self._head(x, self.tensors["token_embd.weight"] if w_out is None else w_out)
        return (logits, state) if return_kv else logits

    def _gated_attention(self, h, p, pos, kv):
        """A full-attention layer with its sigmoid output gate; kv: the layer's (K, V) so far."""
        n, hd = h.shape[0], self.head_dim
        qg = self._linear(h, p + "attn_q").reshape(n, self.n_head, 2, hd)
        q, gate = qg[:, :, 0], qg[:, :, 1]
        k = self._linear(h, p + "attn_k").reshape(n, self.n_head_kv, hd)
        v = self._linear(h, p + "attn_v").reshape(n, self.n_head_kv, self.head_dim_v)
        q = rms_norm(q, self.tensors[p + "attn_q_norm.weight"], self.rms_eps)
        k = rms_norm(k, self.tensors[p + "attn_k_norm.weight"], self.rms_eps)
        rope = dict(n_rot=self.n_rot, sections=self.hybrid.rope_sections, base=self.rope_base,
                    freq_scale=self.rope_freq_scale)
        q, k = dn.imrope(q, pos, **rope), dn.imrope(k, pos, **rope)
        keys, values = np.concatenate([kv[0], k]), np.concatenate([kv[1], v])
        a = attention(q, keys, values, scale=self.attn_scale, q_pos=pos, k_pos=np.arange(len(keys)))
        a = a * dn.sigmoid(gate)
        return self._linear(a.reshape(n, -1), p + "attn_output"), (keys, values)

    def _linear_attention(self, h, p, pos, state):
        """A Gated DeltaNet layer; state: its (convolution, delta rule) states so far."""
        sh, n, t = self.hybrid, h.shape[0], self.tensors
        qkv = self._linear(h, p + "attn_qkv")
        z = self._linear(h, p + "attn_gate").reshape(n, sh.n_v_heads, sh.d_state)
        beta = dn.sigmoid(self._linear(h, p + "ssm_beta"))
        g = dn.softplus(self._linear(h, p + "ssm_alpha") + t[p + "ssm_dt.bias"]) * t[p + "ssm_a"]
        conv, conv_state = dn.causal_conv(qkv, t[p + "ssm_conv1d.weight"], state[0])
        act = dn.silu(conv)
        q = dn.l2_normalize(act[:, :sh.key_dim].reshape(n, sh.n_k_heads, sh.d_state), self.rms_eps)
        k = dn.l2_normalize(act[:, sh.key_dim:2 * sh.key_dim].reshape(n, sh.n_k_heads, sh.d_state), self.rms_eps)
        v = act[:, 2 * sh.key_dim:].reshape(n, sh.n_v_heads, sh.d_state)
        o, ssm_state = dn.delta_rule_recurrent(q, k, v, g, beta, state[1])
        y = rms_norm(o, t[p + "ssm_norm.weight"], self.rms_eps) * dn.silu(z)
        return self._linear(y.reshape(n, sh.value_dim), p + "ssm_out"), (conv_state, ssm_state)

    def _ffn(self, h, p):
        """The dense SwiGLU, or the routed experts plus the gated shared expert."""
        t = self.tensors
        if not self.n_expert:
            return self._linear(silu(self._linear(h, p + "ffn_gate")) * self._linear(h, p + "ffn_up"), p + "ffn_down")
        router = t[p + "ffn_gate_inp.weight"]
        out = routed_experts(h, router, t[p + "ffn_gate_exps.weight"], t[p + "ffn_up_exps.weight"],
                             t[p + "ffn_down_exps.weight"], self.n_expert_used)
        self.last_router_margin = np.minimum(self.last_router_margin, router_margin(h, router, self.n_expert_used))
        shared = self._linear(silu(self._linear(h, p + "ffn_gate_shexp")) * self._linear(h, p + "ffn_up_shexp"),
                              p + "ffn_down_shexp")
        gate = dn.sigmoid(h @ t[p + "ffn_gate_inp_shexp.weight"].reshape(-1).astype(np.float64))
        return out + shared * gate[:, None]


def hybrid_state_bytes(shape: HybridShape) -> int:
    """Bytes of one sequence's recurrent state in f32 (every linear layer's convolution and
    delta-rule state): what the engine's state pool holds per slot."""
    per_layer = (shape.d_conv - 1) * shape.conv_channels + shape.n_v_heads * shape.d_state * shape.d_state
    return 4 * per_layer * sum(shape.recurrent)


__all__ = ["HYBRID_ARCHS", "HybridReferenceModel", "HybridShape", "HybridState", "hybrid_state_bytes",
           "layer_kinds"]
