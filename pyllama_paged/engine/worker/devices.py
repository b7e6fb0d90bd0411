"""GGML's devices as this process sees them, and how a model's layers are split
between a GPU and the CPU (llama.cpp's n_gpu_layers rule: the layers nearest the
output go to the GPU first; the output head goes once every layer is there)."""

from __future__ import annotations

from dataclasses import dataclass

from ..._native import check, ffi, lib
from ...errors import PagedError

DEVICE_TYPES = {lib.PP_DEVICE_CPU: "cpu", lib.PP_DEVICE_GPU: "gpu", lib.PP_DEVICE_IGPU: "igpu",
                lib.PP_DEVICE_ACCEL: "accel"}
# Share of a GPU's free memory (after the weights) the KV pools take by default: the
# rest is for GGML's compute buffers and whatever else runs on that GPU.
DEVICE_KV_FRACTION = 0.8


@dataclass(frozen=True, slots=True)
class Device:
    """One GGML device: its registry index, name, kind and memory in bytes."""

    index: int
    name: str
    description: str
    type: str
    memory_free: int
    memory_total: int

    @property
    def is_gpu(self) -> bool:
        """A GPU (dedicated or integrated): what n_gpu_layers offloads to."""
        return self.type in ("gpu", "igpu")


def list_devices() -> list[Device]:
    """Every device GGML's registry holds, in its order (the CPU included)."""
    info = ffi.new("pp_device_info *")
    out = []
    for i in range(lib.pp_device_count()):
        check(lib.pp_device_get(i, info), f"device {i}")
        out.append(Device(i, ffi.string(info.name).decode(errors="replace"),
                          ffi.string(info.description).decode(errors="replace"), DEVICE_TYPES[info.type],
                          int(info.memory_free), int(info.memory_total)))
    return out


def gpu_device(main_gpu: int = 0) -> Device:
    """The main_gpu-th GPU GGML lists; PagedError naming what exists when there is none."""
    gpus = [d for d in list_devices() if d.is_gpu]
    if not gpus:
        raise PagedError(
            "a GPU was asked for (n_gpu_layers != 0) but GGML lists none: this libggml-python is built "
            "for the CPU only, or no driver exposes a device (see docs/builds-and-gpus.md; a software "
            "Vulkan device needs GGML_VK_VISIBLE_DEVICES)")
    if not 0 <= main_gpu < len(gpus):
        raise PagedError(f"main_gpu {main_gpu} out of range: GGML lists {len(gpus)} GPU(s): "
                         + ", ".join(f"{i}: {d.name} ({d.description})" for i, d in enumerate(gpus)))
    return gpus[main_gpu]


@dataclass(frozen=True, slots=True)
class LayerSplit:
    """Which layers run on the GPU: the last n_device_layers, and the head when output is set."""

    n_layer: int
    n_device_layers: int
    output: bool

    @classmethod
    def for_request(cls, n_gpu_layers: int, n_layer: int) -> "LayerSplit":
        """llama.cpp's rule: -1 (or more than n_layer) offloads everything, head included;
        N <= n_layer offloads the last N layers and keeps the head on the CPU."""
        if n_gpu_layers < -1:
            raise PagedError(f"n_gpu_layers {n_gpu_layers} must be -1 (all) or >= 0")
        if n_gpu_layers == -1 or n_gpu_layers > n_layer:
            return cls(n_layer, n_layer, True)
        return cls(n_layer, n_gpu_layers, False)

    @property
    def first_device_layer(self) -> int:
        return self.n_layer - self.n_device_layers


def device_kv_budget(model, budget: int) -> int:
    """The default KV budget for a model with layers on a GPU: budget, lowered so the GPU's
    share of the pools fits DEVICE_KV_FRACTION of the memory it reports free now."""
    split = model.split
    if split is None or split.n_device_layers == 0:
        return budget
    share = split.n_device_layers / split.n_layer
    free = next(d.memory_free for d in list_devices() if d.index == model.device.index)
    cap = int(DEVICE_KV_FRACTION * free / share)
    return max(1, min(budget, cap))
