"""The float64 oracle of a vision projector file: the SigLIP tower and the Gemma 3 projector.

``VisionReference.from_gguf(path).encode(pixels)`` takes normalised pixels [3, H, W] (H = W =
the file's image size) and returns the image's embedding rows [n_tokens, projection_dim], what
the text model reads in place of the image's placeholder tokens. Every step in float64, from
the file's dequantized weights:

1. the patch embedding: a stride-p convolution, here each p x p x 3 patch flattened (channel,
   row, column) times the kernel as a matrix, plus its bias; patches in row-major order;
2. the learned position embedding added;
3. per block (pre-norm): x += attn(layernorm1(x)); x += mlp(layernorm2(x)), attention over all
   patches (no mask) with scale 1/sqrt(head_dim), the MLP up, GELU (tanh form), down;
4. the post-layernorm;
5. Gemma 3's projector: the patch grid averaged over scale_factor x scale_factor squares
   (row-major output), an RMS norm times ``mm.soft_emb_norm.weight``, then times
   ``mm.input_projection.weight``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from .numpy_model import gelu_tanh, load_tensor, read_gguf, rms_norm, softmax


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis, float64."""
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


@dataclass
class VisionReference:
    projector: str
    image_size: int
    patch_size: int
    n_embd: int
    n_head: int
    n_layer: int
    scale_factor: int
    eps: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    tensors: dict[str, np.ndarray]

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "VisionReference":
        """Read a projector file's hyper-parameters and weights (dequantized, float64)."""
        meta, infos, mm = read_gguf(path)
        tensors = {i.name: load_tensor(mm, i).astype(np.float64) for i in infos}
        return cls(projector=meta["clip.projector_type"], image_size=meta["clip.vision.image_size"],
                   patch_size=meta["clip.vision.patch_size"], n_embd=meta["clip.vision.embedding_length"],
                   n_head=meta["clip.vision.attention.head_count"], n_layer=meta["clip.vision.block_count"],
                   scale_factor=meta.get("clip.vision.projector.scale_factor", 4),
                   eps=meta["clip.vision.attention.layer_norm_epsilon"],
                   image_mean=tuple(meta["clip.vision.image_mean"][:3]),
                   image_std=tuple(meta["clip.vision.image_std"][:3]), tensors=tensors)

    @property
    def n_tokens(self) -> int:
        """Embedding rows one image becomes."""
        return (self.image_size // self.patch_size // self.scale_factor) ** 2

    def normalise(self, rgb: np.ndarray) -> np.ndarray:
        """uint8 [H, W, 3] pixels to the tower's input [3, H, W]: x / 255, less mean, over std."""
        x = rgb.astype(np.float64) / 255.0
        x = (x - np.asarray(self.image_mean)) / np.asarray(self.image_std)
        return x.transpose(2, 0, 1)

    def patches(self, pixels: np.ndarray) -> np.ndarray:
        """[3, H, W] to [n_patches, 3 * p * p], each patch flattened (channel, row, column)."""
        p, side = self.patch_size, self.image_size // self.patch_size
        x = pixels.reshape(3, side, p, side, p)          # c, py, ky, px, kx
        return x.transpose(1, 3, 0, 2, 4).reshape(side * side, 3 * p * p)

    def _linear(self, x: np.ndarray, prefix: str) -> np.ndarray:
        return x @ self.tensors[prefix + ".weight"].T + self.tensors[prefix + ".bias"]

    def _attention(self, x: np.ndarray, b: str) -> np.ndarray:
        n, hd = x.shape[0], self.n_embd // self.n_head
        q = self._linear(x, b + "attn_q").reshape(n, self.n_head, hd).transpose(1, 0, 2)
        k = self._linear(x, b + "attn_k").reshape(n, self.n_head, hd).transpose(1, 0, 2)
        v = self._linear(x, b + "attn_v").reshape(n, self.n_head, hd).transpose(1, 0, 2)
        a = softmax(q @ k.transpose(0, 2, 1) / math.sqrt(hd)) @ v      # [heads, n, hd]
        return self._linear(a.transpose(1, 0, 2).reshape(n, self.n_embd), b + "attn_out")

    def tower(self, pixels: np.ndarray) -> np.ndarray:
        """The vision tower's states [n_patches, n_embd] after the post-layernorm."""
        if pixels.shape != (3, self.image_size, self.image_size):
            raise ValueError(f"pixels must be [3, {self.image_size}, {self.image_size}], got {pixels.shape}")
        t = self.tensors
        kernel = t["v.patch_embd.weight"].reshape(self.n_embd, -1)
        x = self.patches(pixels.astype(np.float64)) @ kernel.T + t["v.patch_embd.bias"]
        x = x + t["v.position_embd.weight"]
        for il in range(self.n_layer):
            b = f"v.blk.{il}."
            x = x + self._attention(layer_norm(x, t[b + "ln1.weight"], t[b + "ln1.bias"], self.eps), b)
            h = layer_norm(x, t[b + "ln2.weight"], t[b + "ln2.bias"], self.eps)
            x = x + self._linear(gelu_tanh(self._linear(h, b + "ffn_up")), b + "ffn_down")
        return layer_norm(x, t["v.post_ln.weight"], t["v.post_ln.bias"], self.eps)

    def project(self, states: np.ndarray) -> np.ndarray:
        """Gemma 3's projector: pool, RMS norm, input projection."""
        side, k = self.image_size // self.patch_size, self.scale_factor
        grid = states.reshape(side // k, k, side // k, k, self.n_embd)
        pooled = grid.mean(axis=(1, 3)).reshape(-1, self.n_embd)
        normed = rms_norm(pooled, self.tensors["mm.soft_emb_norm.weight"], self.eps)
        return normed @ self.tensors["mm.input_projection.weight"]

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """Embedding rows [n_tokens, projection_dim] of normalised pixels [3, H, W]."""
        return self.project(self.tower(pixels))
