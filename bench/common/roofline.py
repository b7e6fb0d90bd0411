"""The roofline of a decode or prefill step on this machine: its two ceilings, measured here,
and what they allow a workload.

- Bandwidth: a NumPy copy of 1 GiB (bytes read plus written; a copy understates what reads
  alone reach, so real decode can pass it by ~20%).
- int8 compute: bench/kernels/int8_peak.c, compiled here for this CPU (-march=native), the widest
  int8 dot-product instruction in independent register chains on --threads threads.

A step reads every weight byte once (but an input embedding apart from the head: a step reads
its tokens' rows of it) and does one multiply-accumulate per weight and token (the
output head only for tokens whose logits are wanted; attention's MACs are left out: at these
contexts a few percent), so it cannot take less than max(weight bytes / bandwidth, MACs / peak).

A mixture-of-experts model is counted by its active parameters: a token multiplies through the
n_used experts it routes to (n_used / n_expert of the expert matrices' MACs), and a step reads
the dense weights whole but only the experts its tokens picked, n_expert * (1 - (1 - n_used /
n_expert) ** n_tokens) per layer if routing is uniform (random weights route near-uniformly;
a trained router's favourites make it fewer, so this floor is the uniform case's).
"""

from __future__ import annotations

import dataclasses
import os
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


@dataclasses.dataclass(frozen=True)
class Weights:
    """What a step of a model reads and multiplies (see the module's docstring)."""
    dense_bytes: int    # read whole by every step: the file less the experts and an untied input embedding
    expert_bytes: int   # all routed experts' matrices (and their biases); 0 for a dense model
    n_expert: int
    n_used: int
    body_macs: int      # per token: every matrix but the embedding and the head, experts at n_used's share
    head_macs: int      # per token whose logits are wanted

    def step_bytes(self, n_tokens: int) -> float:
        """Expected weight bytes a step of n_tokens reads (uniform routing)."""
        if not self.expert_bytes:
            return float(self.dense_bytes)
        touched = 1.0 - (1.0 - self.n_used / self.n_expert) ** n_tokens
        return self.dense_bytes + self.expert_bytes * touched


def model_weights(model_path: str) -> Weights:
    """The model file's Weights: tensor sizes and shapes, and its expert counts from the metadata."""
    import gguf
    reader = gguf.GGUFReader(model_path)
    n_expert = n_used = 0
    for field in reader.fields.values():
        if field.name.endswith(".expert_count"):
            n_expert = int(field.parts[field.data[0]][0])
        elif field.name.endswith(".expert_used_count"):
            n_used = int(field.parts[field.data[0]][0])
    names = {t.name for t in reader.tensors}
    head_name = "output.weight" if "output.weight" in names else "token_embd.weight"
    body = head = expert_bytes = lookup_bytes = 0
    for t in reader.tensors:
        routed = "_exps." in t.name
        if routed:
            expert_bytes += int(t.n_bytes)
        if t.name == "token_embd.weight" and head_name != t.name:
            lookup_bytes = int(t.n_bytes)   # untied: a step reads its tokens' rows only
        if len([d for d in t.shape if d > 1]) < 2 or t.name.endswith(".bias"):
            continue
        n = int(np.prod([int(d) for d in t.shape]))
        if t.name == head_name:
            head = n
        elif routed:
            body += n * n_used // n_expert
        elif t.name != "token_embd.weight":
            body += n
    return Weights(os.path.getsize(model_path) - expert_bytes - lookup_bytes, expert_bytes, n_expert, n_used, body, head)


def macs_per_token(model_path: str) -> tuple[int, int]:
    """(body, head) weight multiply-accumulates per token: every 2-D weight but the input
    embedding (a row lookup) and the output head, routed experts at the share a token uses,
    and the head (output.weight, or the input embedding when tied to it), which a prompt's
    tokens skip but its last."""
    w = model_weights(model_path)
    return w.body_macs, w.head_macs


def step_floor_s(weight_bytes: int, macs: float, bandwidth: float, peak: float) -> float:
    """The least time a step of `macs` multiply-accumulates can take: reading the weights once,
    or the MACs at the int8 peak, whichever binds."""
    return max(weight_bytes / bandwidth, macs / peak)


def batched_ceiling(weights: Weights, npl: int, npp: int, ntg: int, ubatch: int,
                    bandwidth: float, peak: float) -> float:
    """Total tokens/s the llama-batched-bench workload allows: npl prompts of npp tokens in
    ubatch-token steps (the head for each prompt's last token), then ntg steps of npl tokens."""
    body, head = weights.body_macs, weights.head_macs
    prompt = npl * npp
    chunks = [ubatch] * (prompt // ubatch) + ([prompt % ubatch] if prompt % ubatch else [])
    # a prompt's last token falls in the chunk that holds it: the head's MACs per chunk
    ends = [sum(1 for i in range(npl) if sum(chunks[:c]) < (i + 1) * npp <= sum(chunks[:c + 1]))
            for c in range(len(chunks))]
    steps = [(n, n * body + e * head) for n, e in zip(chunks, ends)] + [(npl, npl * (body + head))] * ntg
    return npl * (npp + ntg) / sum(step_floor_s(weights.step_bytes(n), m, bandwidth, peak) for n, m in steps)
