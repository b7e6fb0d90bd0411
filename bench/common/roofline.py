"""The roofline of a decode or prefill step on this machine: its two ceilings, measured here,
and what they allow a workload.

- Bandwidth: a NumPy copy of 1 GiB (bytes read plus written; a copy understates what reads
  alone reach, so real decode can pass it by ~20%).
- int8 compute: bench/kernels/int8_peak.c, compiled here for this CPU (-march=native), the widest
  int8 dot-product instruction in independent register chains on --threads threads.

A step reads every weight byte once and does one multiply-accumulate per weight and token (the
output head only for tokens whose logits are wanted; attention's MACs are left out: at these
contexts a few percent), so it cannot take less than max(weight bytes / bandwidth, MACs / peak).
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

INT8_PEAK_SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "int8_peak.c"


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
        subprocess.run(["cc", "-O2", "-march=native", "-pthread", str(INT8_PEAK_SOURCE), "-o", str(exe)],
                       check=True, capture_output=True, text=True)
        best, isa = 0.0, ""
        for _ in range(repeats):
            out = subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout
            name, rate, _ = out.rsplit(" ", 2)
            isa, best = name, max(best, float(rate))
    return isa, best


def macs_per_token(model_path: str) -> tuple[int, int]:
    """(body, head) weight multiply-accumulates per token: every 2-D weight but the input
    embedding (a row lookup) and the output head, and the head (output.weight, or the input
    embedding when tied to it), which a prompt's tokens skip but its last."""
    import gguf
    reader = gguf.GGUFReader(model_path)
    names = {t.name for t in reader.tensors}
    head_name = "output.weight" if "output.weight" in names else "token_embd.weight"
    body = head = 0
    for t in reader.tensors:
        if len([d for d in t.shape if d > 1]) < 2:
            continue
        n = int(np.prod([int(d) for d in t.shape]))
        if t.name == head_name:
            head = n
        elif t.name != "token_embd.weight":
            body += n
    return body, head


def step_floor_s(weight_bytes: int, macs: float, bandwidth: float, peak: float) -> float:
    """The least time a step of `macs` multiply-accumulates can take: reading the weights once,
    or the MACs at the int8 peak, whichever binds."""
    return max(weight_bytes / bandwidth, macs / peak)


def batched_ceiling(weight_bytes: int, macs: tuple[int, int], npl: int, npp: int, ntg: int, ubatch: int,
                    bandwidth: float, peak: float) -> float:
    """Total tokens/s the llama-batched-bench workload allows: npl prompts of npp tokens in
    ubatch-token steps (the head for each prompt's last token), then ntg steps of npl tokens."""
    body, head = macs
    prompt = npl * npp
    chunks = [ubatch] * (prompt // ubatch) + ([prompt % ubatch] if prompt % ubatch else [])
    # a prompt's last token falls in the chunk that holds it: the head's MACs per chunk
    ends = [sum(1 for i in range(npl) if sum(chunks[:c]) < (i + 1) * npp <= sum(chunks[:c + 1]))
            for c in range(len(chunks))]
    steps = [n * body + e * head for n, e in zip(chunks, ends)] + [npl * (body + head)] * ntg
    return npl * (npp + ntg) / sum(step_floor_s(weight_bytes, m, bandwidth, peak) for m in steps)
