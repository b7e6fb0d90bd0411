"""Model hyper-parameters from GGUF metadata, per architecture."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .._native import lib
from ..errors import ModelLoadError

__all__ = ["ARCH_IDS", "ENCODER_ARCHS", "POOLING_TYPES", "ModelConfig", "ModelLoadError", "config_from_metadata"]

ARCH_IDS = {"llama": lib.PP_ARCH_LLAMA, "qwen2": lib.PP_ARCH_QWEN2, "qwen3": lib.PP_ARCH_QWEN3,
            "gemma3": lib.PP_ARCH_GEMMA3, "bert": lib.PP_ARCH_BERT,
            "qwen3moe": lib.PP_ARCH_QWEN3MOE, "gpt-oss": lib.PP_ARCH_GPT_OSS,
            "qwen35": lib.PP_ARCH_QWEN35, "qwen35moe": lib.PP_ARCH_QWEN35MOE,
            "gemma4": lib.PP_ARCH_GEMMA4}   # enum pp_arch
ENCODER_ARCHS = frozenset({"bert"})   # encoder-only: embeddings, no KV cache, no generation
EXPERT_ARCHS = frozenset({"qwen3moe", "gpt-oss", "qwen35moe"})   # routed experts instead of the dense FFN
# Gated DeltaNet layers beside full-attention ones: a recurrent state per sequence (hybrid_fields)
HYBRID_ARCHS = frozenset({"qwen35", "qwen35moe"})
MAX_D_CONV = 64   # pp_model_create's limits on a hybrid's linear layers
MAX_D_STATE = 1024
YARN_ARCHS = frozenset({"gpt-oss"})   # the archs whose YaRN rope scaling is checked against the reference
# llama.cpp's YaRN: the ramp's ends in turns of the original context (it reads no other from a file)
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
MAX_EXPERTS = 1024   # pp_model_create's limit (llama.cpp's LLAMA_MAX_EXPERTS)
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}   # llama.cpp's <arch>.pooling_type
ROPE_NORMAL, ROPE_NEOX, ROPE_IMROPE = 0, 2, 40   # GGML_ROPE_TYPE_*
# the keys gemma4 may give one value per layer; the generic reads see their largest
PER_LAYER_KEYS = {"gemma4": ("attention.head_count_kv", "feed_forward_length")}


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
    pooling: str | None = None   # <arch>.pooling_type by name; None when the file says nothing
    # mixture of experts (EXPERT_ARCHS; 0: dense). Out of the repr `info` prints, which stays a dense
    # model's; its metadata lines show them.
    n_expert: int = field(default=0, repr=False)
    n_expert_used: int = field(default=0, repr=False)   # experts each token runs
    n_ff_exp: int = field(default=0, repr=False)        # each expert's feed-forward width
    # sliding-window layers' 1 / rope scaling factor (gemma3's are unscaled, gpt-oss's scaled as the others)
    rope_freq_scale_swa: float = field(default=1.0, repr=False)
    # YaRN (rope.scaling.type "yarn", YARN_ARCHS): 0 = none, else GGML's ext_factor (llama.cpp: 1)
    yarn_ext_factor: float = field(default=0.0, repr=False)
    yarn_attn_factor: float = field(default=1.0, repr=False)   # rope.scaling.attn_factor
    n_ctx_orig_yarn: int = field(default=0, repr=False)       # rope.scaling.original_context_length
    # per-layer shapes (gemma4; empty: head_dim, n_head_kv, n_rot, n_ff for every layer)
    layer_head_dim: list[int] = field(default_factory=list, repr=False)
    layer_n_head_kv: list[int] = field(default_factory=list, repr=False)
    layer_n_rot: list[int] = field(default_factory=list, repr=False)
    layer_n_ff: list[int] = field(default_factory=list, repr=False)
    # the layer whose KV each layer reads: -1 its own; else an earlier one (gemma4's shared-KV
    # layers); empty: every layer its own
    layer_kv_source: list[int] = field(default_factory=list, repr=False)
    n_embd_per_layer: int = field(default=0, repr=False)   # gemma4's per-layer embeddings (0: none)
    # Gated DeltaNet hybrids (HYBRID_ARCHS): per layer whether it is recurrent (linear attention),
    # the linear layers' convolution kernel, head size, key heads and value heads, IMRoPE's
    # sections and a shared expert's width (qwen35moe)
    layer_recurrent: list[bool] = field(default_factory=list, repr=False)
    ssm_d_conv: int = field(default=0, repr=False)
    ssm_d_state: int = field(default=0, repr=False)
    ssm_n_group: int = field(default=0, repr=False)
    ssm_dt_rank: int = field(default=0, repr=False)
    rope_sections: tuple[int, int, int, int] = field(default=(0, 0, 0, 0), repr=False)
    n_ff_shexp: int = field(default=0, repr=False)

    @property
    def is_encoder(self) -> bool:
        """An encoder-only model (bert): it embeds, it cannot generate."""
        return self.arch in ENCODER_ARCHS

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    def kv_values(self, il: int) -> int:
        """Values of one token's K (or V) row in layer il (its heads times its head size)."""
        hd = self.layer_head_dim[il] if self.layer_head_dim else self.head_dim
        return hd * (self.layer_n_head_kv[il] if self.layer_n_head_kv else self.n_head_kv)

    def attends(self, il: int) -> bool:
        """Whether layer il is an attention layer (not a hybrid's recurrent one)."""
        return not self.layer_recurrent or not self.layer_recurrent[il]

    def owns_kv(self, il: int) -> bool:
        """Whether layer il computes and keeps its own K/V (else it reads an earlier layer's, or
        it is recurrent and keeps none)."""
        return self.attends(il) and (not self.layer_kv_source or self.layer_kv_source[il] < 0)

    @property
    def is_hybrid(self) -> bool:
        """A model with recurrent (Gated DeltaNet) layers: each sequence also holds a state slot."""
        return any(self.layer_recurrent)

    @property
    def n_attention_layers(self) -> int:
        """The layers that keep K/V (all but a hybrid's recurrent ones)."""
        return self.n_layer - sum(self.layer_recurrent)


_INT32_MAX = 2**31 - 1       # the native hyper-parameters are int32 and float
_FLOAT32_MAX = 3.4028234663852886e38
MAX_LAYERS = 512             # pp_model_create's limit, checked before the per-layer list is built
_REQUIRED = object()


def _describe(value) -> str:
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, (list, tuple)) or hasattr(value, "shape"):
        return f"an array of {len(value)}"
    return f"{type(value).__name__} {value!r}"


def _integers(value) -> list[int] | None:
    """value as a list of ints if it is an array of integers (not booleans), else None."""
    if isinstance(value, (list, tuple)):
        ok = all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in value)
        return [int(v) for v in value] if ok else None
    if hasattr(value, "dtype") and getattr(value, "ndim", 0) == 1 and np.issubdtype(value.dtype, np.integer):
        return [int(v) for v in value]
    return None


class _Fields:
    """Typed, range-checked reads of one architecture's metadata fields."""

    def __init__(self, meta: dict, arch: str, path: str):
        self.meta, self.arch, self.path = meta, arch, path

    def scalar_view(self) -> "_Fields":
        """These fields with PER_LAYER_KEYS' per-layer arrays of integers read as their largest
        entry, for the reads every architecture shares."""
        meta = dict(self.meta)
        for key in PER_LAYER_KEYS.get(self.arch, ()):
            values = _integers(meta.get(f"{self.arch}.{key}"))
            if values:
                meta[f"{self.arch}.{key}"] = max(values)
        return _Fields(meta, self.arch, self.path)

    def per_layer(self, key: str, n_layer: int, default=_REQUIRED, lo: int = 1) -> list[int]:
        """An integer for each layer: one for all, or an array of n_layer (llama.cpp's get_key_or_arr)."""
        value = self._get(key, default)
        if not isinstance(value, (list, tuple)) and not hasattr(value, "shape"):
            return [self.integer(key, default, lo=lo)] * n_layer
        values = _integers(value)
        if values is None or len(values) != n_layer or not all(lo <= v <= _INT32_MAX for v in values):
            self._fail(key, f"must be an integer or {n_layer} integers >= {lo}, got {_describe(value)}")
        return values

    def _get(self, key: str, default):
        full = f"{self.arch}.{key}"
        if full not in self.meta:
            if default is _REQUIRED:
                raise ModelLoadError(f"{self.path}: missing metadata field '{full}'")
            return default
        return self.meta[full]

    def _fail(self, key: str, problem: str):
        raise ModelLoadError(f"{self.path}: metadata field '{self.arch}.{key}' {problem}")

    def integer(self, key: str, default=_REQUIRED, lo: int = 1, hi: int = _INT32_MAX) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            self._fail(key, f"must be an integer, got {_describe(value)}")
        if not lo <= value <= hi:
            self._fail(key, f"is {value}, outside [{lo}, {hi}]")
        return int(value)

    def number(self, key: str, default, *, positive: bool = False) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            self._fail(key, f"must be a number, got {_describe(value)}")
        value = float(value)
        if not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX) or value < 0 or (positive and value == 0):
            self._fail(key, f"is {value}; it must be finite and {'positive' if positive else '>= 0'}")
        return value

    def text(self, key: str, default: str) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            self._fail(key, f"must be a string, got {_describe(value)}")
        return value


def _architecture(meta: dict, n_vocab: int | None, path: str) -> str:
    """The file's general.architecture, one we run, once its vocabulary is known to fit."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path}: missing metadata field 'general.architecture'")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{path}: metadata field 'general.architecture' must be a string, "
                             f"got {_describe(arch)}")
    if arch not in ARCH_IDS:
        raise ModelLoadError(
            f"{path}: architecture '{arch}' is not supported (supported: {', '.join(ARCH_IDS)})")
    if not n_vocab:
        raise ModelLoadError(f"{path}: no vocabulary: neither 'tokenizer.ggml.tokens' nor "
                             "tensor 'token_embd.weight' is present")
    if n_vocab > _INT32_MAX:
        raise ModelLoadError(f"{path}: vocabulary of {n_vocab} tokens is too large")
    return arch


def config_from_metadata(meta: dict, n_vocab: int | None, path: str) -> ModelConfig:
    """Build a ModelConfig from GGUF key/values; errors name the file and key.
    Every field is type- and range-checked here, so no metadata value can make
    this raise anything but ModelLoadError or hand the native core a value that
    does not fit its int32/float fields."""
    arch = _architecture(meta, n_vocab, path)
    f = _Fields(meta, arch, path).scalar_view()
    n_embd = f.integer("embedding_length")
    n_head = f.integer("attention.head_count")
    n_head_kv = f.integer("attention.head_count_kv", n_head)
    head_dim = f.integer("attention.key_length", n_embd // n_head)
    if f.integer("attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{path}: value_length != key_length is not supported")
    n_layer = f.integer("block_count", hi=MAX_LAYERS)
    if arch in HYBRID_ARCHS:   # block_count counts the multi-token-prediction layers after the trunk
        n_layer -= f.integer("nextn_predict_layers", 0, lo=0, hi=n_layer - 1)
    n_rot = f.integer("rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise ModelLoadError(f"{path}: rope.dimension_count {n_rot} must be even and at most "
                             f"key_length {head_dim}")
    scaling_type = f.text("rope.scaling.type", "none")
    scaling_factor = f.number("rope.scaling.factor", 1.0) or 1.0  # 0 means none, as in llama.cpp
    yarn = scaling_type == "yarn" and scaling_factor != 1.0
    if yarn and arch not in YARN_ARCHS:
        raise ModelLoadError(f"{path}: rope scaling 'yarn' is supported for {', '.join(sorted(YARN_ARCHS))} "
                             f"only, not '{arch}'")
    if scaling_type not in ("none", "linear", "yarn") and scaling_factor != 1.0:
        raise ModelLoadError(f"{path}: rope scaling '{scaling_type}' is not supported")
    cfg = ModelConfig(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        # an expert model's dense width is informational (its experts have their own)
        n_ff=f.integer("feed_forward_length", 0, lo=0) if arch in EXPERT_ARCHS else f.integer("feed_forward_length"),
        n_vocab=n_vocab,
        n_ctx_train=f.integer("context_length", 4096),
        rope_type=ROPE_NORMAL if arch == "llama" else ROPE_IMROPE if arch in HYBRID_ARCHS else ROPE_NEOX,
        rope_freq_base=f.number("rope.freq_base", 10000.0, positive=True),
        rope_freq_scale=1.0 / scaling_factor,
        rope_freq_base_swa=10000.0,
        rms_eps=f.number("attention.layer_norm_rms_epsilon", 1e-6, positive=True),
        attn_scale=1.0 / math.sqrt(head_dim),
        embd_scale=1.0,
        final_logit_softcap=f.number("final_logit_softcapping", 0.0),
        layer_window=[0] * n_layer,
        n_rot=n_rot,
    )
    pooling = f.integer("pooling_type", -1, lo=-1, hi=max(POOLING_TYPES))
    cfg.pooling = POOLING_TYPES.get(pooling)
    if arch in ENCODER_ARCHS:
        _encoder_fields(cfg, f)
    if arch in EXPERT_ARCHS:
        _expert_fields(cfg, f)
    if arch in HYBRID_ARCHS:
        _hybrid_fields(cfg, f)
    if yarn:
        _yarn_fields(cfg, f)
    _layer_fields(cfg, f, meta)
    if n_head % n_head_kv:
        raise ModelLoadError(f"{path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    return cfg


def _layer_fields(cfg: ModelConfig, f: _Fields, meta: dict) -> None:
    """Each architecture's own layers: which slide and over what, their rope and scales."""
    window = f.integer("attention.sliding_window", 0, lo=0)
    if f.arch == "gemma3":
        # Gemma 3 scales embeddings by sqrt(n_embd); five of every six layers
        # use sliding-window attention with a 10k RoPE base (llama.cpp's
        # swa pattern of 6), the sixth is global with rope.freq_base.
        cfg.embd_scale = math.sqrt(cfg.n_embd)
        cfg.layer_window = [window if (il % 6) < 5 else 0 for il in range(cfg.n_layer)]
        scalar = f.number("attention.query_pre_attn_scalar", 0.0)
        if scalar:
            cfg.attn_scale = 1.0 / math.sqrt(scalar)
    elif f.arch == "gpt-oss":
        _gpt_oss_fields(cfg, f)
    elif f.arch == "gemma4":
        _gemma4_fields(cfg, _Fields(meta, f.arch, f.path))   # the per-layer arrays as they are
    elif window and f.arch == "llama":  # Mistral v0.1 style: every layer windowed
        cfg.layer_window = [window] * cfg.n_layer


def _expert_fields(cfg: ModelConfig, f: _Fields) -> None:
    """Routed experts: how many, how many each token runs and their width. As in llama.cpp, the
    width defaults to feed_forward_length / expert_used_count."""
    cfg.n_expert = f.integer("expert_count", hi=MAX_EXPERTS)
    cfg.n_expert_used = f.integer("expert_used_count")
    if cfg.n_expert_used > cfg.n_expert:
        raise ModelLoadError(f"{f.path}: metadata field '{f.arch}.expert_used_count' is {cfg.n_expert_used}, "
                             f"more than the {cfg.n_expert} experts of '{f.arch}.expert_count'")
    derived = cfg.n_ff // cfg.n_expert_used
    cfg.n_ff_exp = f.integer("expert_feed_forward_length", derived if derived > 0 else _REQUIRED)
    cfg.n_ff = cfg.n_ff or cfg.n_ff_exp * cfg.n_expert_used


def _hybrid_fields(cfg: ModelConfig, f: _Fields) -> None:
    """A Qwen3.5/3.6 hybrid as llama.cpp reads it: the layer kinds (attention.recurrent_layers,
    else every full_attention_interval-th layer attends, 4 by default), the linear layers'
    ssm.* sizes (inner_size must be state_size value heads), IMRoPE's rope.dimension_sections
    and qwen35moe's shared expert (expert_shared_feed_forward_length, else feed_forward_length)."""
    cfg.layer_recurrent = _layer_kinds(cfg, f)
    n_recurrent = sum(cfg.layer_recurrent)
    if not 0 < n_recurrent < cfg.n_layer:
        raise ModelLoadError(f"{f.path}: a {f.arch} model needs recurrent and full-attention layers; "
                             f"{n_recurrent} of its {cfg.n_layer} layers are recurrent")
    cfg.ssm_d_conv = f.integer("ssm.conv_kernel", lo=2, hi=MAX_D_CONV)
    cfg.ssm_d_state = f.integer("ssm.state_size", hi=MAX_D_STATE)
    cfg.ssm_n_group = f.integer("ssm.group_count")
    cfg.ssm_dt_rank = f.integer("ssm.time_step_rank", hi=4096)
    if cfg.ssm_dt_rank % cfg.ssm_n_group:
        f._fail("ssm.time_step_rank", f"is {cfg.ssm_dt_rank}: the value heads must be a multiple of "
                                      f"ssm.group_count's {cfg.ssm_n_group} key heads")
    inner = f.integer("ssm.inner_size")
    if inner != cfg.ssm_d_state * cfg.ssm_dt_rank:
        f._fail("ssm.inner_size", f"is {inner}, but ssm.state_size {cfg.ssm_d_state} x ssm.time_step_rank "
                                  f"{cfg.ssm_dt_rank} value heads is {cfg.ssm_d_state * cfg.ssm_dt_rank}")
    cfg.rope_sections = _rope_sections(cfg, f)
    if f.arch == "qwen35moe":   # llama.cpp's default is the file's own feed_forward_length, if any
        dense = f.integer("feed_forward_length", 0, lo=0)
        cfg.n_ff_shexp = f.integer("expert_shared_feed_forward_length", dense or _REQUIRED)


def _layer_kinds(cfg: ModelConfig, f: _Fields) -> list[bool]:
    """Per trunk layer whether it is a Gated DeltaNet layer."""
    flags = f._get("attention.recurrent_layers", None)
    if flags is None:
        interval = f.integer("full_attention_interval", 4, hi=MAX_LAYERS)
        return [(il + 1) % interval != 0 for il in range(cfg.n_layer)]
    if not (isinstance(flags, (list, tuple)) or hasattr(flags, "shape")) or len(flags) < cfg.n_layer or \
            not all(isinstance(b, (bool, np.bool_)) for b in flags):
        f._fail("attention.recurrent_layers", f"must be {cfg.n_layer} booleans, got {_describe(flags)}")
    return [bool(b) for b in flags[:cfg.n_layer]]


def _rope_sections(cfg: ModelConfig, f: _Fields) -> tuple[int, int, int, int]:
    """IMRoPE's four sections of rotary pairs, as GGML's rope takes them."""
    sections = f._get("rope.dimension_sections", _REQUIRED)
    if not (isinstance(sections, (list, tuple)) or hasattr(sections, "shape")) or not 1 <= len(sections) <= 4 or \
            not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in sections):
        f._fail("rope.dimension_sections", f"must be up to 4 integers, got {_describe(sections)}")
    out = tuple(int(v) for v in sections) + (0,) * (4 - len(sections))
    if min(out) < 0 or sum(out[:3]) == 0 or sum(out) > cfg.head_dim:
        f._fail("rope.dimension_sections", f"is {list(out)}: sections must be >= 0, the first three not all 0, "
                                           f"their sum at most key_length {cfg.head_dim}")
    return out


def _yarn_fields(cfg: ModelConfig, f: _Fields) -> None:
    """YaRN as llama.cpp runs it from a GGUF: ext_factor 1, beta 32/1 whatever the file says, the
    original context from rope.scaling.original_context_length (else context_length), cos/sin
    times rope.scaling.attn_factor; a yarn_log_multiplier (DeepSeek's) is not modelled."""
    if f.number("rope.scaling.yarn_log_multiplier", 0.0):
        f._fail("rope.scaling.yarn_log_multiplier", "is set; YaRN with a log multiplier is not supported")
    cfg.yarn_ext_factor = 1.0
    cfg.yarn_attn_factor = f.number("rope.scaling.attn_factor", 1.0, positive=True)
    cfg.n_ctx_orig_yarn = f.integer("rope.scaling.original_context_length", cfg.n_ctx_train)


def _gpt_oss_fields(cfg: ModelConfig, f: _Fields) -> None:
    """gpt-oss (llama.cpp's openai-moe): a required sliding window on the layers of a pattern of 2
    (even layers slide; sliding_window_pattern overrides it), whose rope is the full layers' own
    (YaRN included) unless rope.freq_base_swa is given; attention scaled by 1/sqrt(n_rot)."""
    window = f.integer("attention.sliding_window")
    cfg.layer_window = [window if s else 0 for s in _sliding_layers(f, cfg.n_layer, 2)]
    cfg.rope_freq_base_swa = f.number("rope.freq_base_swa", cfg.rope_freq_base, positive=True)
    cfg.rope_freq_scale_swa = cfg.rope_freq_scale
    cfg.attn_scale = 1.0 / math.sqrt(cfg.n_rot)


def _sliding_layers(f: _Fields, n_layer: int, period) -> list[bool]:
    """Which layers slide, from sliding_window_pattern: a boolean per layer, or a period whose
    last layer is full (0: every layer slides); period is the default."""
    pattern = f._get("attention.sliding_window_pattern", period)
    if isinstance(pattern, (list, tuple)) or hasattr(pattern, "shape"):   # the reader gives arrays as numpy's
        if len(pattern) < n_layer or not all(isinstance(b, (bool, np.bool_)) for b in pattern):
            f._fail("attention.sliding_window_pattern", f"must be {n_layer} booleans, got {_describe(pattern)}")
        return [bool(b) for b in pattern[:n_layer]]
    period = f.integer("attention.sliding_window_pattern", period, lo=0, hi=MAX_LAYERS)
    return [period == 0 or il % period < period - 1 for il in range(n_layer)]


def _encoder_fields(cfg: ModelConfig, f: _Fields) -> None:
    """bert: a layer norm (not RMS) epsilon, learned positions over context_length, no RoPE,
    bidirectional attention; mean pooling unless the file says otherwise."""
    cfg.rms_eps = f.number("attention.layer_norm_epsilon", 1e-12, positive=True)
    cfg.n_ctx_train = f.integer("context_length", 512)
    if f.meta.get(f"{f.arch}.attention.causal") in (True, 1):
        raise ModelLoadError(f"{f.path}: a causal {f.arch} model is not supported")
    if cfg.pooling is None:
        cfg.pooling = "mean"


def _gemma4_fields(cfg: ModelConfig, f: _Fields) -> None:
    """Gemma 4 (llama.cpp's gemma4): sliding layers (sliding_window_pattern, a required window)
    with key_length_swa heads and dimension_count_swa rotated dims at rope.freq_base_swa
    (default 10000), unscaled; full layers with key_length / dimension_count at rope.freq_base;
    head_count_kv and feed_forward_length once or per layer; the last shared_kv_layers layers
    read the KV of the last earlier layer of their kind; per-layer embeddings of
    embedding_length_per_layer_input values (required; 0: none); attention scale 1 (q and k are
    normed), embeddings times sqrt(n_embd); experts where expert_count is given."""
    n = cfg.n_layer
    sliding = _sliding_layers(f, n, _REQUIRED)
    window = f.integer("attention.sliding_window")
    head_swa = f.integer("attention.key_length_swa", cfg.head_dim, hi=512)
    if f.integer("attention.value_length_swa", head_swa) != head_swa:
        raise ModelLoadError(f"{f.path}: value_length_swa != key_length_swa is not supported")
    rot_swa = f.integer("rope.dimension_count_swa", cfg.n_rot)
    if rot_swa > head_swa or rot_swa % 2:
        f._fail("rope.dimension_count_swa", f"is {rot_swa}; it must be even and at most key_length_swa {head_swa}")
    cfg.layer_window = [window if s else 0 for s in sliding]
    cfg.layer_head_dim = [head_swa if s else cfg.head_dim for s in sliding]
    cfg.layer_n_rot = [rot_swa if s else cfg.n_rot for s in sliding]
    cfg.layer_n_head_kv = f.per_layer("attention.head_count_kv", n, cfg.n_head)
    cfg.layer_n_ff = f.per_layer("feed_forward_length", n)
    for il, kv in enumerate(cfg.layer_n_head_kv):
        if cfg.n_head % kv:
            raise ModelLoadError(f"{f.path}: layer {il}: head_count {cfg.n_head} is not a multiple of its "
                                 f"head_count_kv {kv}")
    cfg.layer_kv_source = _shared_kv_sources(f, sliding, f.integer("attention.shared_kv_layers", 0, lo=0, hi=n - 1))
    cfg.n_embd_per_layer = f.integer("embedding_length_per_layer_input", lo=0)
    cfg.rope_freq_base_swa = f.number("rope.freq_base_swa", 10000.0, positive=True)
    cfg.rope_freq_scale_swa = 1.0
    cfg.attn_scale = 1.0
    cfg.embd_scale = math.sqrt(cfg.n_embd)
    if f.integer("expert_count", 0, lo=0):
        _expert_fields(cfg, f)


def _shared_kv_sources(f: _Fields, sliding: list[bool], n_shared: int) -> list[int]:
    """-1 for each layer with KV of its own, then for each of the last n_shared layers the last
    earlier such layer of its kind (where Gemma 4's layers end, llama.cpp's n_kv_from_start - 2
    for a sliding one and - 1 for a full one)."""
    n_own = len(sliding) - n_shared
    sources = [-1] * n_own
    for il in range(n_own, len(sliding)):
        same_kind = [j for j in range(n_own) if sliding[j] == sliding[il]]
        if not same_kind:
            kind = "sliding" if sliding[il] else "full"
            raise ModelLoadError(f"{f.path}: layer {il} shares KV ({f.arch}.attention.shared_kv_layers = {n_shared}), "
                                 f"but no earlier layer of its kind ({kind} attention) has KV of its own")
        sources.append(same_kind[-1])
    return sources
