"""Model hyper-parameters from GGUF metadata, per architecture."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import PagedError

ARCH_IDS = {"llama": 0, "qwen2": 1, "qwen3": 2, "gemma3": 3}
ROPE_NORMAL, ROPE_NEOX = 0, 2


class ModelLoadError(PagedError):
    """A GGUF file cannot be used; the message names the file and the field or tensor."""


@dataclass
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_type: int
    rope_freq_base: float
    rope_freq_scale: float
    rope_freq_base_swa: float
    rms_eps: float
    attn_scale: float
    embd_scale: float
    final_logit_softcap: float
    layer_window: list[int] = field(default_factory=list)
    n_rot: int = 0            # rotated dims per head (rope.dimension_count); 0 = head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim


def config_from_metadata(meta: dict, n_vocab: int | None, path: str) -> ModelConfig:
    """Build a ModelConfig from GGUF key/values; errors name the file and key."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path}: missing metadata field 'general.architecture'")
    if arch not in ARCH_IDS:
        raise ModelLoadError(
            f"{path}: architecture '{arch}' is not supported (supported: {', '.join(ARCH_IDS)})")

    if not n_vocab:
        raise ModelLoadError(f"{path}: no vocabulary: neither 'tokenizer.ggml.tokens' nor "
                             "tensor 'token_embd.weight' is present")

    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelLoadError(f"{path}: missing metadata field '{full}'")
        return meta[full]

    def opt(key: str, default):
        return meta.get(f"{arch}.{key}", default)

    n_embd = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_head_kv = int(opt("attention.head_count_kv", n_head))
    head_dim = int(opt("attention.key_length", n_embd // n_head if n_head else 0))
    if int(opt("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{path}: value_length != key_length is not supported")
    n_layer = int(need("block_count"))
    n_rot = int(opt("rope.dimension_count", head_dim))
    if n_rot <= 0 or n_rot > head_dim or n_rot % 2:
        raise ModelLoadError(f"{path}: rope.dimension_count {n_rot} must be even and at most "
                             f"key_length {head_dim}")
    scaling_type = opt("rope.scaling.type", "none")
    scaling_factor = float(opt("rope.scaling.factor", 1.0) or 1.0)
    if scaling_type not in ("none", "linear") and scaling_factor != 1.0:
        raise ModelLoadError(f"{path}: rope scaling '{scaling_type}' is not supported")
    cfg = ModelConfig(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=int(need("feed_forward_length")),
        n_vocab=n_vocab,
        n_ctx_train=int(opt("context_length", 4096)),
        rope_type=ROPE_NORMAL if arch == "llama" else ROPE_NEOX,
        rope_freq_base=float(opt("rope.freq_base", 10000.0)),
        rope_freq_scale=1.0 / scaling_factor,
        rope_freq_base_swa=10000.0,
        rms_eps=float(opt("attention.layer_norm_rms_epsilon", 1e-6)),
        attn_scale=1.0 / math.sqrt(head_dim) if head_dim else 0.0,
        embd_scale=1.0,
        final_logit_softcap=float(opt("final_logit_softcapping", 0.0) or 0.0),
        layer_window=[0] * n_layer,
        n_rot=n_rot,
    )
    if arch == "gemma3":
        # Gemma 3 scales embeddings by sqrt(n_embd); five of every six layers
        # use sliding-window attention with a 10k RoPE base (llama.cpp's
        # swa pattern of 6), the sixth is global with rope.freq_base.
        cfg.embd_scale = math.sqrt(n_embd)
        window = int(opt("attention.sliding_window", 0) or 0)
        cfg.layer_window = [window if (il % 6) < 5 else 0 for il in range(n_layer)]
        scalar = opt("attention.query_pre_attn_scalar", None)
        if scalar:
            cfg.attn_scale = 1.0 / math.sqrt(float(scalar))
    elif arch in ("llama", "qwen2", "qwen3"):
        window = int(opt("attention.sliding_window", 0) or 0)
        if window and arch == "llama":  # Mistral v0.1 style: every layer windowed
            cfg.layer_window = [window] * n_layer
    for name, value in (("block_count", n_layer), ("embedding_length", n_embd),
                        ("attention.head_count", n_head), ("attention.head_count_kv", n_head_kv),
                        ("attention.key_length", head_dim)):
        if value <= 0:
            raise ModelLoadError(f"{path}: metadata field '{arch}.{name}' must be positive, got {value}")
    if n_head % n_head_kv:
        raise ModelLoadError(f"{path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    return cfg
