"""Random K-quant blocks written directly, for synthetic models of a real model's size
(pyllama_paged/testing/synthetic_gguf.py): no float weights are ever made, so a multi-billion
parameter file takes seconds. Random 4- and 6-bit values under one scale per tensor,
centred, with the standard deviation a trained model's layers have.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
Q4_K_BYTES = 144   # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit values
Q6_K_BYTES = 210   # 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, fp16 d

# Every sub-block's 6-bit scale and min in Q4_K, and every 16-value scale in Q6_K: with
# one d per tensor these give the values their spread; min / scale = 7.5 / 8 centres 4-bit
# values (mean 7.5) under dmin = 8 d.
Q4_K_SCALE, Q4_K_MIN = 40, 38
Q6_K_SCALE = 16


def q4_k_scale_bytes(scale: int, minimum: int) -> np.ndarray:
    """The 12 packed bytes holding eight equal 6-bit scales and eight equal 6-bit mins."""
    low = np.array([scale & 63 | (scale >> 4) << 6] * 4 + [minimum & 63 | (minimum >> 4) << 6] * 4, np.uint8)
    high = np.array([(scale & 15) | (minimum & 15) << 4] * 4, np.uint8)
    return np.concatenate([low, high])


def q4_k_blocks(rng: np.random.Generator, n_rows: int, n_cols: int, std: float) -> np.ndarray:
    """[n_rows, n_cols / 256 * 144] bytes of Q4_K with zero-mean values of about `std`."""
    n_blocks = n_rows * (n_cols // QK_K)
    d = std / (Q4_K_SCALE * np.sqrt((16 ** 2 - 1) / 12))   # uniform 0..15: std 4.61
    out = np.empty((n_blocks, Q4_K_BYTES), np.uint8)
    out[:, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    out[:, 2:4] = np.frombuffer(np.float16(8 * d).tobytes(), np.uint8)
    out[:, 4:16] = q4_k_scale_bytes(Q4_K_SCALE, Q4_K_MIN)
    out[:, 16:] = rng.integers(0, 256, (n_blocks, 128), dtype=np.uint8)
    return out.reshape(n_rows, -1)


def q6_k_blocks(rng: np.random.Generator, n_rows: int, n_cols: int, std: float) -> np.ndarray:
    """[n_rows, n_cols / 256 * 210] bytes of Q6_K with zero-mean values of about `std`."""
    n_blocks = n_rows * (n_cols // QK_K)
    d = std / (Q6_K_SCALE * np.sqrt((64 ** 2 - 1) / 12))   # uniform 0..63 minus 32: std 18.5
    out = np.empty((n_blocks, Q6_K_BYTES), np.uint8)
    out[:, :192] = rng.integers(0, 256, (n_blocks, 192), dtype=np.uint8)
    out[:, 192:208] = Q6_K_SCALE
    out[:, 208:210] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    return out.reshape(n_rows, -1)
