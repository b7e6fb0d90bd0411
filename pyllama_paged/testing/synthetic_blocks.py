"""Random K-quant, Q8_0 and MXFP4 blocks written directly, for synthetic models of a real
model's size (pyllama_paged/testing/synthetic_gguf.py): no float weights are ever made, so a
multi-billion parameter file takes seconds. Random 4-, 6- and 8-bit values (MXFP4: random
E2M1 codes) under one scale per tensor, centred, with the standard deviation a trained
model's layers have.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
Q4_K_BYTES = 144   # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit values
Q6_K_BYTES = 210   # 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, fp16 d
QK_32 = 32         # Q8_0's and MXFP4's block length
Q8_0_BYTES = 34    # fp16 d, 32 int8 values
MXFP4_BYTES = 17   # an E8M0 exponent (scale 2^(e - 127)), 16 bytes of two E2M1 codes each
# The RMS of E2M1's 16 codes (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) drawn uniformly.
E2M1_RMS = float(np.sqrt(np.mean(np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]) ** 2)))

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


def q8_0_blocks(rng: np.random.Generator, n_rows: int, n_cols: int, std: float) -> np.ndarray:
    """[n_rows, n_cols / 32 * 34] bytes of Q8_0 with zero-mean values of about `std`."""
    n_blocks = n_rows * (n_cols // QK_32)
    d = std / np.sqrt((255 ** 2 - 1) / 12)   # uniform -127..127: std 73.6
    out = np.empty((n_blocks, Q8_0_BYTES), np.uint8)
    out[:, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    out[:, 2:] = rng.integers(-127, 128, (n_blocks, QK_32), dtype=np.int8).view(np.uint8)
    return out.reshape(n_rows, -1)


def mxfp4_blocks(rng: np.random.Generator, n_rows: int, n_cols: int, std: float) -> np.ndarray:
    """[n_rows, n_cols / 32 * 17] bytes of MXFP4 with zero-mean values of about `std` (the
    nearest power-of-two scale: MXFP4's scales are powers of two)."""
    n_blocks = n_rows * (n_cols // QK_32)
    exponent = int(np.clip(np.rint(np.log2(std / E2M1_RMS)) + 127, 0, 254))
    out = np.empty((n_blocks, MXFP4_BYTES), np.uint8)
    out[:, 0] = exponent
    out[:, 1:] = rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)
    return out.reshape(n_rows, -1)
