"""Write tiny vision projector ("mmproj") GGUFs with random weights, laid out like llama.cpp's.

``write_tiny_mmproj(path, projection_dim=...)`` produces a real GGUF whose ``general.architecture``
is ``clip``, with the ``clip.*`` keys and tensor names llama.cpp's mtmd reads (its
``tools/mtmd/clip-impl.h`` is the specification): a SigLIP-style vision tower (a patch
embedding convolution, learned position embeddings, pre-norm ViT blocks with a GELU MLP, a
post-layernorm) and the Gemma 3 projector (an average pool of ``scale_factor`` x
``scale_factor`` patches, an RMS norm, the input projection into the text model's width).

Shapes are GGML's (ne[0] the row length): ``v.patch_embd.weight`` [p, p, 3, n_embd] (a
convolution kernel), ``v.position_embd.weight`` [n_embd, n_patches], the blocks' matrices
[in, out], ``mm.input_projection.weight`` [projection_dim, n_embd] (llama.cpp multiplies by its
transpose). The FFN is written ``ffn_up`` = n_embd -> n_ff and ``ffn_down`` = n_ff -> n_embd;
n_ff must differ from n_embd, because llama.cpp takes a gemma3 file whose ``ffn_down`` rows are
n_embd long for one written with the two swapped.
"""

from __future__ import annotations

import os

import gguf
import numpy as np

from .tiny_gguf import quantize_tensor, resolve_type

PROJECTOR_TYPES = ("gemma3",)

# Small enough for quick tests, big enough that every step matters: 8 x 8 patches pooled 2 x 2
# into 16 image tokens, two heads, two blocks.
TINY_VISION = dict(image_size=32, patch_size=4, n_embd=64, n_head=2, n_ff=96, n_layer=2, scale_factor=2)


def _matrix(rng: np.random.Generator, n_out: int, n_in: int) -> np.ndarray:
    return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)


class _Writer:
    """Adds tensors of a weight type (F32 for vectors, as llama.cpp keeps norms and biases)."""

    def __init__(self, w: gguf.GGUFWriter, rng: np.random.Generator, weight_type: str):
        self.w, self.rng, self.weight_type = w, rng, weight_type

    def weight(self, name: str, data: np.ndarray) -> None:
        wtype = resolve_type(self.weight_type, data.shape[-1])
        if wtype == "f32":
            self.w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
            return
        arr, qt = quantize_tensor(data.reshape(-1, data.shape[-1]), wtype)
        self.w.add_tensor(name, arr.reshape(*data.shape[:-1], -1) if arr.ndim > 1 else arr, raw_dtype=qt)

    def vector(self, name: str, n: int, center: float = 0.0, spread: float = 0.1) -> None:
        self.w.add_tensor(name, (center + spread * self.rng.standard_normal(n)).astype(np.float32))

    def linear(self, prefix: str, n_out: int, n_in: int) -> None:
        self.weight(prefix + ".weight", _matrix(self.rng, n_out, n_in))
        self.vector(prefix + ".bias", n_out)


def _add_metadata(w: gguf.GGUFWriter, v: dict, projection_dim: int, projector: str) -> None:
    w.add_string("clip.projector_type", projector)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", v["image_size"])
    w.add_uint32("clip.vision.patch_size", v["patch_size"])
    w.add_uint32("clip.vision.embedding_length", v["n_embd"])
    w.add_uint32("clip.vision.feed_forward_length", v["n_ff"])
    w.add_uint32("clip.vision.block_count", v["n_layer"])
    w.add_uint32("clip.vision.projection_dim", projection_dim)
    w.add_uint32("clip.vision.attention.head_count", v["n_head"])
    w.add_float32("clip.vision.attention.layer_norm_epsilon", v["eps"])
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_uint32("clip.vision.projector.scale_factor", v["scale_factor"])


def write_tiny_mmproj(path: str | os.PathLike, *, projection_dim: int, projector: str = "gemma3",
                      weight_type: str = "f16", seed: int = 0, eps: float = 1e-6, **sizes: int) -> str:
    """Write a random-weight projector file for a text model ``projection_dim`` wide; ``sizes``
    override ``TINY_VISION``'s entries. Returns the path."""
    if projector not in PROJECTOR_TYPES:
        raise ValueError(f"unsupported projector {projector!r}; choose from {PROJECTOR_TYPES}")
    unknown = set(sizes) - set(TINY_VISION)
    if unknown:
        raise ValueError(f"unknown sizes {sorted(unknown)}; choose from {sorted(TINY_VISION)}")
    v = {**TINY_VISION, **sizes, "eps": eps}
    side = v["image_size"] // v["patch_size"]
    if side * v["patch_size"] != v["image_size"] or side % v["scale_factor"]:
        raise ValueError("image_size must be patch_size x a multiple of scale_factor")
    if v["n_ff"] == v["n_embd"] or v["n_embd"] % v["n_head"]:
        raise ValueError("n_ff must differ from n_embd, and n_head divide n_embd")
    w = gguf.GGUFWriter(os.fspath(path), "clip")
    w.add_name(f"tiny {projector} projector")
    _add_metadata(w, v, projection_dim, projector)
    t = _Writer(w, np.random.default_rng(seed), weight_type)
    d, p = v["n_embd"], v["patch_size"]
    # the patch convolution sees 3 * p * p normalised pixels per output
    t.weight("v.patch_embd.weight", _matrix(t.rng, d, 3 * p * p).reshape(d, 3, p, p))
    t.vector("v.patch_embd.bias", d)
    w.add_tensor("v.position_embd.weight", (0.5 * t.rng.standard_normal((side * side, d))).astype(np.float32))
    for il in range(v["n_layer"]):
        b = f"v.blk.{il}."
        t.vector(b + "ln1.weight", d, center=1.0)
        t.vector(b + "ln1.bias", d)
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t.linear(b + name, d, d)
        t.vector(b + "ln2.weight", d, center=1.0)
        t.vector(b + "ln2.bias", d)
        t.linear(b + "ffn_up", v["n_ff"], d)
        t.linear(b + "ffn_down", d, v["n_ff"])
    t.vector("v.post_ln.weight", d, center=1.0)
    t.vector("v.post_ln.bias", d)
    t.vector("mm.soft_emb_norm.weight", d, center=1.0)
    # stored [n_embd rows of projection_dim]: the text width is the row length; kept float
    # (llama.cpp transposes it in the graph, which a quantized tensor cannot be)
    proj = _matrix(t.rng, projection_dim, d).T.copy()
    if weight_type in ("f32", "f16"):
        t.weight("mm.input_projection.weight", proj)
    else:
        _Writer(w, t.rng, "f16").weight("mm.input_projection.weight", proj)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)
