"""The shapes of the models people run, as presets for the synthetic GGUF writer
(pyllama_paged/testing/synthetic_gguf.py), and a way to shrink one for fast tests.

Each preset is a real model's architecture, hyper-parameters and tokenizer family, so a
file written from it has the real model's weight bytes, KV bytes per token and prompt
lengths; only the weights are random. `shrink` keeps everything a test can check cheaply
(architecture, vocabulary, tokenizer, head size, grouped-query ratio, type mix) and cuts the
layer count and widths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .synthetic_blocks import QK_32, QK_K


@dataclass(frozen=True)
class Preset:
    """One model shape: what the writer needs besides the random weights."""

    name: str
    arch: str                 # gemma3, llama, qwen2, qwen3moe, gpt-oss, qwen35 or qwen35moe (llama.cpp's names)
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int                 # the dense FFN's width (a mixture of experts states it, unused)
    tokenizer: str            # "source": the default gemma3 model's; else a synthetic_bpe family
    n_vocab: int | None = None   # None: as many as the tokenizer has
    tied: bool = True         # the output head is token_embd (no output.weight)
    # None below: the source model's value (gemma3 presets copy the default model's metadata)
    context_length: int | None = None
    rope_freq_base: float | None = None
    rms_eps: float | None = None
    sliding_window: int | None = None
    rope_scaling_linear: float | None = None   # gemma3 4B+: global layers' positions / 8
    llama3_rope: bool = False  # rope_freqs.weight from Llama 3.1/3.2's long-context rule
    real_params: int | None = None   # the real model's parameter count (text model), to compare
    file_name: str = ""
    # routed experts in place of the dense FFN (qwen3moe, gpt-oss): how many, how many a token runs, their width
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    # "q4_k_m": llama.cpp's Q4_K_M; "mxfp4": gpt-oss's release (MXFP4 experts, Q8_0 elsewhere)
    type_mix: str = "q4_k_m"
    yarn_factor: float | None = None       # YaRN rope scaling over yarn_original_context positions
    yarn_original_context: int = 0
    # gemma4: the sliding layers' head size and KV heads (0: head_dim, n_head_kv: those are the
    # full layers'), layers sliding il % swa_period < swa_period - 1, the last n_kv_shared reading
    # earlier layers' KV, per-layer embeddings of n_embd_per_layer, no V on full layers (k_eq_v)
    head_dim_swa: int = 0
    n_head_kv_swa: int = 0
    swa_period: int = 0
    n_kv_shared: int = 0
    n_embd_per_layer: int = 0
    k_eq_v: bool = False
    final_logit_softcap: float | None = None

    def sliding(self) -> list[bool]:
        """Which layers slide (gemma4's period; [] for the other architectures)."""
        period = self.swa_period
        return [il % period < period - 1 for il in range(self.n_layer)] if period else []

    def kv_heads(self) -> int | list[int]:
        """head_count_kv as the converter writes it: one count, or one per layer where they differ."""
        sliding = self.sliding()
        if not sliding or self.n_head_kv_swa in (0, self.n_head_kv):
            return self.n_head_kv
        return [self.n_head_kv_swa if s else self.n_head_kv for s in sliding]
    # Gated DeltaNet hybrids (qwen35, qwen35moe): every full_attention_interval-th layer attends,
    # the others are linear layers of ssm_n_group query/key heads and ssm_dt_rank value heads
    # of ssm_d_state each, with a convolution of ssm_d_conv; full attention rotates n_rot dims
    # in IMRoPE's rope_sections; a shared expert of n_ff_shexp beside the routed ones
    ssm_d_conv: int = 0
    ssm_d_state: int = 0
    ssm_n_group: int = 0
    ssm_dt_rank: int = 0
    full_attention_interval: int = 0
    n_rot: int = 0
    rope_sections: tuple[int, ...] = ()
    n_ff_shexp: int = 0

    @property
    def hybrid(self) -> bool:
        """A Gated DeltaNet hybrid (qwen35, qwen35moe)."""
        return self.full_attention_interval > 0

    @property
    def block(self) -> int:
        """The row length every matrix of the type mix is a multiple of."""
        return QK_32 if self.type_mix == "mxfp4" else QK_K

    @property
    def approx_params(self) -> int:
        """About how many parameters the full-size file holds: the embedding, head and every
        layer's attention and FFN matrices as a dense model's (a hybrid's linear layers are
        about as large), for deciding what is too big to write."""
        vocab = self.n_vocab or 262144
        attention = (2 * self.q_dim + 2 * self.n_head_kv * self.head_dim) * self.n_embd
        width = self.n_expert * self.n_ff_exp + self.n_ff_shexp if self.n_expert else self.n_ff
        return vocab * self.n_embd * (1 if self.tied else 2) + self.n_layer * (attention + 3 * self.n_embd * width)

    @property
    def q_dim(self) -> int:
        """Width of the attention's query projection (heads times head size)."""
        return self.n_head * self.head_dim

    def check(self) -> None:
        """Raise ValueError if a quantized row would not be whole blocks or the heads do not group.
        (gemma4's FFN widths need only be whole Q8_0 blocks: synthetic_gguf then writes that
        type, as llama-quantize falls back for rows that are not whole K-quant blocks.)"""
        ff_block = QK_32 if self.arch == "gemma4" else self.block
        widths = [("n_embd", self.n_embd, self.block), ("n_ff", self.n_ff, ff_block),
                  ("n_head * head_dim", self.q_dim, self.block)]
        widths += [("n_ff_exp", self.n_ff_exp, ff_block)] if self.n_expert else []
        widths += [("n_ff_shexp", self.n_ff_shexp, self.block)] if self.n_ff_shexp else []
        widths += [("ssm_dt_rank * ssm_d_state", self.ssm_dt_rank * self.ssm_d_state, self.block)] if self.hybrid else []
        for what, v, block in widths:
            if v % block:
                raise ValueError(f"{self.name}: {what} = {v} must be a multiple of {block} for "
                                 f"{self.type_mix}'s rows")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"{self.name}: n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.hybrid and self.ssm_dt_rank % self.ssm_n_group:
            raise ValueError(f"{self.name}: {self.ssm_dt_rank} value heads are not a multiple of "
                             f"{self.ssm_n_group} key heads")
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"{self.name}: n_expert_used {self.n_expert_used} must be between 1 and "
                             f"n_expert {self.n_expert}")


# Shapes from each model's Hugging Face config.json. Parameter counts are the text model's
# (Gemma 3 4B's 4.3B includes a 0.4B vision tower, which a text-only GGUF does not carry).
PRESETS: dict[str, Preset] = {p.name: p for p in (
    # no real counterpart: a Gemma 3 between the 1B and the 4B, the benchmarks' long-standing model
    Preset("gemma3-1.6b", "gemma3", n_embd=2048, n_layer=18, n_head=8, n_head_kv=4, head_dim=256,
           n_ff=8192, tokenizer="source", file_name="gemma3-synthetic-1.6b-q4_k_m.gguf"),
    Preset("gemma3-4b", "gemma3", n_embd=2560, n_layer=34, n_head=8, n_head_kv=4, head_dim=256,
           n_ff=10240, tokenizer="source", context_length=131072, rope_freq_base=1e6, rms_eps=1e-6,
           sliding_window=1024, rope_scaling_linear=8.0, real_params=3_880_263_168,
           file_name="gemma3-synthetic-4b-q4_k_m.gguf"),
    Preset("llama3.2-1b", "llama", n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, head_dim=64,
           n_ff=8192, tokenizer="llama3", n_vocab=128256, context_length=131072, rope_freq_base=500000.0,
           rms_eps=1e-5, llama3_rope=True, real_params=1_235_814_400,
           file_name="llama3.2-synthetic-1b-q4_k_m.gguf"),
    Preset("llama3.2-3b", "llama", n_embd=3072, n_layer=28, n_head=24, n_head_kv=8, head_dim=128,
           n_ff=8192, tokenizer="llama3", n_vocab=128256, context_length=131072, rope_freq_base=500000.0,
           rms_eps=1e-5, llama3_rope=True, real_params=3_212_749_824,
           file_name="llama3.2-synthetic-3b-q4_k_m.gguf"),
    Preset("qwen2.5-1.5b", "qwen2", n_embd=1536, n_layer=28, n_head=12, n_head_kv=2, head_dim=128,
           n_ff=8960, tokenizer="qwen2", n_vocab=151936, context_length=32768, rope_freq_base=1e6,
           rms_eps=1e-6, real_params=1_543_714_304, file_name="qwen2.5-synthetic-1.5b-q4_k_m.gguf"),
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token (3.3B of its 30.5B parameters active); the
    # Qwen2 tokenizer's vocabulary, an untied head; 40960 positions (the 2507 and Coder
    # releases say 262144)
    Preset("qwen3-30b-a3b", "qwen3moe", n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128,
           n_ff=6144, tokenizer="qwen2", n_vocab=151936, tied=False, context_length=40960, rope_freq_base=1e6,
           rms_eps=1e-6, n_expert=128, n_expert_used=8, n_ff_exp=768, real_params=30_532_122_624,
           file_name="qwen3-synthetic-30b-a3b-q4_k_m.gguf"),
    # gpt-oss-20b: 32 experts of 2880, 4 per token (3.6B of its 20.9B parameters active); head_dim
    # 64 with n_embd 2880 (not 64 x 64 heads); even layers slide over 128 positions; YaRN x32 over
    # 4096; o200k_harmony's vocabulary, an untied head; its release's type mix (MXFP4 experts)
    Preset("gpt-oss-20b", "gpt-oss", n_embd=2880, n_layer=24, n_head=64, n_head_kv=8, head_dim=64,
           n_ff=2880, tokenizer="gpt-oss", n_vocab=201088, tied=False, context_length=131072,
           rope_freq_base=150000.0, rms_eps=1e-5, sliding_window=128, n_expert=32, n_expert_used=4,
           n_ff_exp=2880, type_mix="mxfp4", yarn_factor=32.0, yarn_original_context=4096,
           real_params=20_914_757_184, file_name="gpt-oss-synthetic-20b-mxfp4.gguf"),
    # Gemma 4 E4B: 42 layers, five sliding (512 positions, heads of 256) then a full one (heads of
    # 512, proportional rope), the last 18 reading earlier layers' KV, per-layer embeddings of 256
    # (a 10752 x 262144 table); Gemma's vocabulary (the default model's tokenizer), a tied head
    Preset("gemma4-e4b", "gemma4", n_embd=2560, n_layer=42, n_head=8, n_head_kv=2, head_dim=512,
           n_ff=10240, tokenizer="source", context_length=131072, rope_freq_base=1e6, rms_eps=1e-6,
           sliding_window=512, head_dim_swa=256, swa_period=6, n_kv_shared=18, n_embd_per_layer=256,
           final_logit_softcap=30.0, file_name="gemma4-synthetic-e4b-q4_k_m.gguf"),
    # Gemma 4 26B-A4B: 30 layers, five sliding (1024 positions, 8 KV heads of 256) then a full one
    # (2 KV heads of 512, no V projection: K stands in), 128 experts of 704, 8 per token, beside a
    # dense FFN of 2112 (rows that are not whole K-quant blocks: Q8_0, see check)
    Preset("gemma4-26b-a4b", "gemma4", n_embd=2816, n_layer=30, n_head=16, n_head_kv=2, head_dim=512,
           n_ff=2112, tokenizer="source", context_length=262144, rope_freq_base=1e6, rms_eps=1e-6,
           sliding_window=1024, n_expert=128, n_expert_used=8, n_ff_exp=704, head_dim_swa=256,
           n_head_kv_swa=8, swa_period=6, k_eq_v=True, final_logit_softcap=30.0,
           file_name="gemma4-synthetic-26b-a4b-q4_k_m.gguf"),
    # Qwen3.5-9B: 3 of every 4 layers Gated DeltaNet (16 key heads, 32 value heads, of 128), full
    # attention with an output gate (16 heads of 256 on 4 KV heads, a quarter of each rotated in
    # IMRoPE sections 11/11/10); Qwen3.5's vocabulary, an untied head (its MTP block left out)
    Preset("qwen3.5-9b", "qwen35", n_embd=4096, n_layer=32, n_head=16, n_head_kv=4, head_dim=256,
           n_ff=12288, tokenizer="qwen35", n_vocab=248320, tied=False, context_length=262144,
           rope_freq_base=1e7, rms_eps=1e-6, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32,
           full_attention_interval=4, n_rot=64, rope_sections=(11, 11, 10, 0),
           file_name="qwen3.5-synthetic-9b-q4_k_m.gguf"),
    # Qwen3.6-35B-A3B (Qwen3.5-35B-A3B's shape): 40 layers, Qwen3.5's mixers (2 KV heads) and 256
    # experts of 512, 8 per token, with a shared expert of 512 behind a sigmoid gate
    Preset("qwen3.6-35b-a3b", "qwen35moe", n_embd=2048, n_layer=40, n_head=16, n_head_kv=2, head_dim=256,
           n_ff=512, tokenizer="qwen35", n_vocab=248320, tied=False, context_length=262144, rope_freq_base=1e7,
           rms_eps=1e-6, n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, ssm_d_conv=4,
           ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32, full_attention_interval=4, n_rot=64,
           rope_sections=(11, 11, 10, 0), file_name="qwen3.6-synthetic-35b-a3b-q4_k_m.gguf"),
)}
DEFAULT = "gemma3-1.6b"


def get(name: str) -> Preset:
    """The preset called name; ValueError listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None


def shrink(preset: Preset, n_layer: int = 2, n_ff: int = 512) -> Preset:
    """A small copy of preset: same architecture, vocabulary, tokenizer, head size, query
    heads per KV head and experts (how many, how many a token runs), with n_layer layers, the
    fewest heads whose width is whole K-quant blocks, n_embd that width (at least 256), n_ff
    and experts one K-quant block wide (256 values, whole blocks of any type mix). A hybrid
    has a linear layer then a full-attention one (full_attention_interval 2), its state size,
    one key head with its value heads, and n_embd 512."""
    if preset.arch == "gemma4":
        return _shrink_gemma4(preset, n_ff)
    group = preset.n_head // preset.n_head_kv
    n_head_kv = 1
    while (n_head_kv * group * preset.head_dim) % QK_K:
        n_head_kv += 1
    n_head = n_head_kv * group
    n_embd = max(QK_K, n_head * preset.head_dim)
    hybrid = {}
    if preset.hybrid:
        # a linear layer then a full-attention one (interval 2), one key head and its value
        # heads, and a residual stream of 512 (heads of 256 would make it 1024 or 2048 wide, and
        # Qwen3.6's 256 experts and 248k-row embedding over that a file of most of a GB)
        n_embd = 2 * QK_K
        hybrid = dict(ssm_n_group=1, ssm_dt_rank=preset.ssm_dt_rank // preset.ssm_n_group,
                      n_ff_shexp=QK_K if preset.n_ff_shexp else 0, full_attention_interval=2)
    small = dataclasses.replace(
        preset, name=f"{preset.name}-small", n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
        n_embd=n_embd, n_ff=n_ff, real_params=None,
        n_ff_exp=QK_K if preset.n_expert else 0, **hybrid,
        file_name=preset.file_name.replace("-q4_k_m", "-small-q4_k_m").replace("-mxfp4", "-small-mxfp4"))
    small.check()
    return small


def _shrink_gemma4(preset: Preset, n_ff: int) -> Preset:
    """gemma4's small copy: a sliding then a full layer (twice, the second pair reading the first's
    KV, where the preset shares KV), the fewest heads of the full layers' ratio, the sliding
    layers' ratio and both head sizes, n_embd one K-quant block, per-layer embeddings of 64 values
    (their table's rows, 64 per layer, whole K-quant blocks over the four layers)."""
    shares = preset.n_kv_shared > 0
    group = preset.n_head // preset.n_head_kv
    n_head = group
    swa_group = preset.n_head // (preset.n_head_kv_swa or preset.n_head_kv)
    small = dataclasses.replace(
        preset, name=f"{preset.name}-small", n_layer=4 if shares else 2, swa_period=2, n_kv_shared=2 if shares else 0,
        n_head=n_head, n_head_kv=1, n_head_kv_swa=n_head // swa_group if preset.n_head_kv_swa else 0, n_embd=QK_K,
        n_ff=n_ff, n_ff_exp=QK_K if preset.n_expert else 0, n_embd_per_layer=64 if preset.n_embd_per_layer else 0,
        real_params=None, file_name=preset.file_name.replace("-q4_k_m", "-small-q4_k_m"))
    small.check()
    return small
