"""The roofline of a decode or prefill step on this machine: its two ceilings, measured here,
and what they allow a workload.

- Bandwidth: a NumPy copy of 1 GiB (bytes read plus written; a copy understates what reads
  alone reach, so real decode can pass it by ~20%).
- int8 compute: bench/int8_peak.c, compiled here for this CPU (-march=native), the widest
  int8 dot-product instruction in independent register chains on --threads threads.

A step reads every weight byte once and does one multiply-accumulate per weight and token
(attention's MACs are left out: at these contexts a few percent), so it cannot take less than
max(weight bytes / bandwidth, tokens x MACs per token / peak).
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent


def copy_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a large copy moves (read + written): the decode roofline's bandwidth."""
    src = np.ones(n_bytes // 8)
    dst = np.empty_like(src)
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t = time.perf_counter() - t0
        best = t if best is None or t < best else best
    return 2 * n_bytes / best


def int8_peak(threads: int, repeats: int = 3) -> tuple[str, float]:
    """(instruction, int8 multiply-accumulates per second) of this CPU on `threads` threads."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "int8_peak"
        subprocess.run(["cc", "-O2", "-march=native", "-pthread", str(BENCH / "int8_peak.c"), "-o", str(exe)],
                       check=True, capture_output=True, text=True)
        best, isa = 0.0, ""
        for _ in range(repeats):
            out = subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout
            name, rate, _ = out.rsplit(" ", 2)
            isa, best = name, max(best, float(rate))
    return isa, best


def macs_per_token(model_path: str) -> int:
    """Weight multiply-accumulates per token: every 2-D weight but the input embedding (a row
    lookup), which counts once as the head when output.weight is tied to it."""
    import gguf
    reader = gguf.GGUFReader(model_path)
    names = {t.name: t for t in reader.tensors}
    total = 0
    for t in reader.tensors:
        if len([d for d in t.shape if d > 1]) < 2:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        total += int(np.prod([int(d) for d in t.shape]))
    return total


def step_floor_s(weight_bytes: int, macs: float, tokens: int, bandwidth: float, peak: float) -> float:
    """The least time a step of `tokens` tokens can take: memory or compute, whichever binds."""
    return max(weight_bytes / bandwidth, tokens * macs / peak)


def batched_ceiling(weight_bytes: int, macs: float, npl: int, npp: int, ntg: int, ubatch: int,
                    bandwidth: float, peak: float) -> float:
    """Total tokens/s the llama-batched-bench workload allows: npl prompts of npp tokens in
    ubatch-token steps, then ntg steps of npl tokens."""
    prompt = npl * npp
    steps = [ubatch] * (prompt // ubatch) + ([prompt % ubatch] if prompt % ubatch else [])
    steps += [npl] * ntg
    return npl * (npp + ntg) / sum(step_floor_s(weight_bytes, macs, n, bandwidth, peak) for n in steps)
