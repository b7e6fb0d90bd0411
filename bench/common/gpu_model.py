"""The committed prediction for the next GPU loan: a decode step's time from the bytes it moves,
the kernels it launches and the host time around it, for our engine and for llama.cpp, on the
H100 and H200 the loan lends, for every workload bench/device_bench.py runs (issue 53, item 4).

    t_device = (weight bytes + KV bytes) / (bandwidth x BW_EFFICIENCY) + kernels x KERNEL_GAP_S
    t_step   = t_device + kernels x LAUNCH_S (only for a step not replayed as a CUDA graph) + host

- Bytes: every weight matrix once per step (Q4_K_M's Q4_K/Q6_K mix, the tied Q6_K head included),
  plus each sequence's keys and values: llama.cpp's flash attention reads the f16 cache in place
  (2 bytes a value); our device graph gathers them with get_rows, which writes F32, and GGML's CUDA
  flash attention converts F32 K/V back to F16 before reading (fattn.cu, need_f16_K): read f16 (2),
  write f32 (4), read f32 (4), write f16 (2), read f16 (2) = KV_BYTES_OURS per value.
- Kernels: ours counted on our real decode graph (bench/engine/graph_replay.py's export) minus the
  fusions GGML 0.20.2's CUDA backend applies in node order; llama.cpp's from its llama graph's ops
  per layer (LLAMA_CPP_KERNELS_PER_LAYER), an estimate until a loan dumps its graph.
- CUDA graphs: llama.cpp's CMake turns them on; our carry builds GGML with them
  (bench/gpu_carry.sh); the replay share is graph_replay.py's (256 decode steps: 0.97-0.99).
- Host: llama-batched-bench's C++ loop is taken as HOST_LLAMA_CPP_S a step; ours is calibrated from
  our one H200 run (bench/README.md, GPU section), see HOST_OURS_*.

Calibration (each constant says where it comes from): the device constants from llama.cpp's
CUDA-graph issue (ggml-org/llama.cpp#6763, NVIDIA's Alan Gray): llama-2-7b Q4_K_M on an H100 PCIe,
-ngl 100 -n 128, 143.35 tokens/s without CUDA graphs and 163.83 with; the bandwidths from NVIDIA's
datasheets. Prefill is compute-bound and modelled at PREFILL_FLOPS_EFFICIENCY of the dense FP16
tensor peak: the least certain line (no published H100 pp figure for these files was at hand).

`python -m bench.common.gpu_model` writes bench/results/gpu_predictions.{json,md}; device_bench.py
prints each prediction beside its measurement (prediction_for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# ---- devices (NVIDIA datasheets: HBM bandwidth, dense FP16 tensor peak without sparsity) ----------
DEVICES = {
    "H100 SXM": {"bandwidth": 3.35e12, "fp16_flops": 989e12},
    "H100 PCIe": {"bandwidth": 2.0e12, "fp16_flops": 756e12},
    "H200": {"bandwidth": 4.8e12, "fp16_flops": 989e12},
}

# ---- calibration ---------------------------------------------------------------------------
# llama.cpp#6763: 7B Q4_K_M (3.80 GiB) on an H100 PCIe: 1/143.35 = 6.976 ms a token eagerly,
# 1/163.83 = 6.104 ms replayed. Its graph then launched about 26 kernels a layer (no fusions),
# 32 layers: ~835. The difference, 0.872 ms, is the host launch cost graphs remove:
LLAMA2_7B_KERNELS = 835
LAUNCH_S = (1 / 143.35 - 1 / 163.83) / LLAMA2_7B_KERNELS           # ~1.04 us a kernel
# What stays per kernel when replayed (the GPU drains one kernel before the next): an assumption
# of 1.5 us, within the 1-2 us NVIDIA's CUDA-graph post measures between dependent kernels.
KERNEL_GAP_S = 1.5e-6
# The rest of the replayed token is bytes: 4.08 GB / (6.104 ms - 835 x 1.5 us) over 2.0 TB/s.
LLAMA2_7B_BYTES = 3.80 * 2 ** 30
BW_EFFICIENCY = LLAMA2_7B_BYTES / (1 / 163.83 - LLAMA2_7B_KERNELS * KERNEL_GAP_S) / DEVICES["H100 PCIe"]["bandwidth"]
# Prompt processing: quantized GEMMs through MMQ/cuBLAS reach a fraction of the FP16 peak; 0.15
# is an assumption (the order of llama.cpp's pp512 figures on high-end NVIDIA cards).
PREFILL_FLOPS_EFFICIENCY = 0.15

# Host time per step. llama-batched-bench: a C++ loop around llama_decode (no sampling): 0.1 ms.
HOST_LLAMA_CPP_S = 1.0e-4
# Ours, from the one H200 run (ours alone, CUDA graphs off, 2026-11-25): the 1B file, npl 1:
# 256 tokens (128 prompt + 128 generated) in 0.522 s, i.e. ~4.0 ms a decode step after a ~5 ms
# prefill. The device model above gives ~1.4 ms for that step eagerly; the remaining ~2.6 ms is
# the engine's own host time a step (scheduler, inputs, GGML's scheduler, sampling), taken as fixed.
# Per sequence, 20 us a step (a row's bookkeeping and argmax read-back; on the CPU, LLMEngine's
# steps cost 1-2 ms more than ModelRunner's at 64 sequences, bench/results/step_overhead.md).
H200_RUN_NPL1_S = 0.522
HOST_OURS_PER_SEQ_S = 20e-6

Q4_K_BYTES_PER_VALUE = 144 / 256
Q6_K_BYTES_PER_VALUE = 210 / 256
KV_BYTES_LLAMA_CPP = 2          # f16 read in place by flash attention
KV_BYTES_OURS = 2 + 4 + 4 + 2 + 2   # get_rows f16 -> f32, F32 -> F16 conversion, attention's read

# llama.cpp's llama layer in decode (flash attention, f16 cache), after 0.20.2's CUDA fusions:
# rms_norm+mul, q, k, v, rope q, rope k+view+set_rows, v set_rows, flash attention, o, add,
# rms_norm+mul, gate+up+glu (one MMVQ kernel up to 8 columns, three above), down, add.
LLAMA_CPP_KERNELS_PER_LAYER = {"small_batch": 13, "large_batch": 15}
LLAMA_CPP_KERNELS_FIXED = 4     # embedding rows, output rms_norm+mul, head, (argmax: not in batched-bench)
MMVQ_MAX_BATCH = 8              # GGML's MMVQ (and its GLU fusion) takes up to 8 columns

# Ours, counted by cuda_kernels() on our real decode graph (tests/bench/test_gpu_model.py checks
# them on a tiny model's graph): a layer's 23 ops less the views, with RMS_NORM+MUL fused twice
# (19), plus the two F32 -> F16 conversions CUDA's flash attention runs for gathered K and V. K's
# ROPE -> RESHAPE -> VIEW(slots) -> SET_ROWS misses GGML's {ROPE, VIEW, SET_ROWS} fusion, and the
# gate/up products' reshape to 128-value rows (a CPU trick) keeps MMVQ from fusing the GLU.
OUR_KERNELS_PER_LAYER = 19 + 2
OUR_KERNELS_FIXED = 6           # embedding rows, the last layer's two logit-row gathers, the head
                                # (one for its rms_norm+mul, one for the product) and the argmax


@dataclass(frozen=True)
class Shape:
    """What the model puts on the device per step."""

    name: str
    n_layer: int
    n_embd: int
    q_dim: int
    kv_dim: int
    n_ff: int
    n_vocab: int

    @classmethod
    def from_preset(cls, name: str) -> "Shape":
        """A synthetic preset's shape (pyllama_paged/testing/synthetic_presets.py)."""
        from pyllama_paged.testing.synthetic_presets import get
        p = get(name)
        return cls(name, p.n_layer, p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim, p.n_ff, p.n_vocab)

    def weight_bytes(self) -> float:
        """Bytes of every matrix a decode step reads once (Q4_K_M's mix, the tied Q6_K head)."""
        from pyllama_paged.testing.synthetic_gguf import more_bits
        total = self.n_vocab * self.n_embd * Q6_K_BYTES_PER_VALUE
        for il in range(self.n_layer):
            v_down = Q6_K_BYTES_PER_VALUE if more_bits(il, self.n_layer) else Q4_K_BYTES_PER_VALUE
            total += (2 * self.q_dim * self.n_embd + self.kv_dim * self.n_embd + 2 * self.n_ff * self.n_embd) \
                * Q4_K_BYTES_PER_VALUE
            total += self.kv_dim * self.n_embd * v_down + self.n_ff * self.n_embd * v_down
        return total

    def kv_values(self, n_tokens: int) -> int:
        """K and V values n_tokens of context hold over every layer."""
        return 2 * self.n_layer * self.kv_dim * n_tokens

    def params(self) -> int:
        """Parameters a token's forward multiplies with (matrices and the head)."""
        per_layer = 2 * self.q_dim * self.n_embd + 2 * self.kv_dim * self.n_embd + 3 * self.n_ff * self.n_embd
        return self.n_layer * per_layer + self.n_vocab * self.n_embd


def our_kernels(shape: Shape) -> int:
    """Our kernels a decode step (any npl: the graph's ops do not depend on it)."""
    return OUR_KERNELS_PER_LAYER * shape.n_layer + OUR_KERNELS_FIXED


def llama_cpp_kernels(shape: Shape, npl: int) -> int:
    """llama.cpp's kernels a decode step of npl sequences (estimate, see the constant)."""
    per = LLAMA_CPP_KERNELS_PER_LAYER["small_batch" if npl <= MMVQ_MAX_BATCH else "large_batch"]
    return per * shape.n_layer + LLAMA_CPP_KERNELS_FIXED


def step_seconds(engine: str, shape: Shape, device: str, npl: int, ctx: int, kernels: int,
                 replay_share: float = 1.0) -> dict:
    """One decode step of npl sequences at ctx tokens each: its parts and its time."""
    bw = DEVICES[device]["bandwidth"] * BW_EFFICIENCY
    kv_bytes = shape.kv_values(ctx) * npl * (KV_BYTES_OURS if engine == "ours" else KV_BYTES_LLAMA_CPP)
    device_s = (shape.weight_bytes() + kv_bytes) / bw + kernels * KERNEL_GAP_S
    launch_s = kernels * LAUNCH_S * (1 - replay_share)
    host_s = host_seconds(engine, npl)
    return {"weights_gb": shape.weight_bytes() / 1e9, "kv_gb": kv_bytes / 1e9, "kernels": kernels,
            "device_ms": device_s * 1e3, "launch_ms": launch_s * 1e3, "host_ms": host_s * 1e3,
            "step_ms": (device_s + launch_s + host_s) * 1e3}


def prefill_seconds(shape: Shape, device: str, n_tokens: int) -> float:
    """A prompt's forward: compute-bound products (2 flops a parameter a token)."""
    return 2 * shape.params() * n_tokens / (DEVICES[device]["fp16_flops"] * PREFILL_FLOPS_EFFICIENCY)


def _host_ours_fixed() -> float:
    """Our host time a step, calibrated on the H200 run (see H200_RUN_NPL1_S): the run's decode
    step less the device model's eager step (that run's graph at one sequence had today's ops)."""
    shape = Shape.from_preset("llama3.2-1b")
    decode_s = (H200_RUN_NPL1_S - prefill_seconds(shape, "H200", NPP)) / NTG
    kernels = our_kernels(shape)
    bw = DEVICES["H200"]["bandwidth"] * BW_EFFICIENCY
    device_s = (shape.weight_bytes() + shape.kv_values(NPP + NTG // 2) * KV_BYTES_OURS) / bw
    return max(0.0, decode_s - device_s - kernels * (KERNEL_GAP_S + LAUNCH_S) - HOST_OURS_PER_SEQ_S)


def host_seconds(engine: str, npl: int) -> float:
    """Host time a step that a GPU does not remove."""
    if engine != "ours":
        return HOST_LLAMA_CPP_S
    return _host_ours_fixed() + HOST_OURS_PER_SEQ_S * npl


# ---- workloads (bench/device_bench.py's defaults) --------------------------------------------
BATCHED_NPL = (1, 16, 64)
NPP = NTG = 128
SINGLE_PP, SINGLE_TG = 512, 128
CHAT_REQUESTS, CHAT_RATE, CHAT_OUTPUT_MEAN = 32, 16.0, 160


def batched_tps(engine, shape, device, npl, kernels, replay_share) -> float:
    """llama-batched-bench's total tokens/s: npl x (npp + ntg) over prefill and ntg steps."""
    t = prefill_seconds(shape, device, npl * NPP)
    for i in range(NTG):
        t += step_seconds(engine, shape, device, npl, NPP + i, kernels, replay_share)["step_ms"] / 1e3
    return npl * (NPP + NTG) / t


def chat_tps(engine, shape, device, kernels, replay_share, n_parallel: int) -> float:
    """The chat trace's output tokens/s, coarsely: arrivals over CHAT_REQUESTS / CHAT_RATE
    seconds, then rounds of n_parallel requests decoding together for ~2.5x the mean output
    (a log-normal's longest of a round), at a mean context of 1k tokens."""
    rounds = math.ceil(CHAT_REQUESTS / n_parallel)
    step = step_seconds(engine, shape, device, min(n_parallel, CHAT_REQUESTS), 1024, kernels, replay_share)
    t = CHAT_REQUESTS / CHAT_RATE + rounds * 2.5 * CHAT_OUTPUT_MEAN * step["step_ms"] / 1e3
    return CHAT_REQUESTS * CHAT_OUTPUT_MEAN / t


# ---- kernels from a real graph ------------------------------------------------------------
# Ops GGML's CUDA backend runs no kernel for (ggml_cuda_is_view_or_noop).
NO_KERNEL = {"RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "NONE"}
# GGML 0.20.2's CUDA fusions that a llama-like decode graph can meet, longest first; each needs its
# ops on consecutive nodes (views included, as ggml_can_fuse reads them).
FUSIONS = (("RMS_NORM", "MUL", "ROPE", "VIEW", "SET_ROWS"), ("RMS_NORM", "MUL", "ROPE"), ("RMS_NORM", "MUL", "ADD"),
           ("RMS_NORM", "MUL"), ("ROPE", "VIEW", "SET_ROWS"), ("MUL_MAT", "MUL_MAT", "SWIGLU"),
           ("MUL_MAT", "MUL_MAT", "GEGLU"), ("SCALE", "TANH", "SCALE"))


def cuda_kernels(ops: list[str], columns: list[int], f32_kv: bool = True) -> int:
    """Kernels GGML's CUDA backend launches for a graph's nodes (ops in node order, and each
    node's ne[1]), after its fusions; f32_kv: flash attention's K and V arrive as F32 and are
    converted to F16 first (two more kernels a call)."""
    kernels, i = 0, 0
    while i < len(ops):
        fused = next((f for f in FUSIONS if tuple(ops[i:i + len(f)]) == f
                      and (f[0] != "MUL_MAT" or columns[i] <= MMVQ_MAX_BATCH)), None)
        if fused:
            kernels += 1
            i += len(fused)
            continue
        if ops[i] not in NO_KERNEL:
            kernels += 1 + (2 if ops[i] == "FLASH_ATTN_EXT" and f32_kv else 0)
        i += 1
    return kernels


def graph_kernels(step_graph) -> int:
    """cuda_kernels of a StepGraph (pyllama_paged.testing.cuda_graph_replay)."""
    from pyllama_paged._native import ffi
    nodes = [step_graph.nodes[i] for i in range(len(step_graph.hashes))]
    return cuda_kernels([ffi.string(n.op).decode() for n in nodes], [int(n.ne[1]) for n in nodes])


# ---- the table -------------------------------------------------------------------------------
MODELS = {"llama3.2-1b": "llama3.2-1b", "llama3.2-3b": "llama3.2-3b"}   # device_bench's labels -> presets
# graph_replay.py's replay share of steady decode (256 steps at 128 + 256 tokens); llama.cpp's
# graph repeats likewise until its KV view grows by 256 (taken as the same share).
REPLAY_SHARE = 0.97


def predictions(device: str) -> list[dict]:
    """Ours and llama.cpp's predicted figures for every device_bench workload on one device."""
    rows = []
    for label, preset in MODELS.items():
        shape = Shape.from_preset(preset)
        ours_k = our_kernels(shape)

        def row(workload, setting, ours, theirs, unit="t/s"):
            rows.append({"device": device, "model": label, "workload": workload, "setting": setting,
                         "ours": ours, "llama.cpp": theirs, "ours / llama.cpp": ours / theirs, "unit": unit})

        for npl in BATCHED_NPL:
            row("batched t/s", f"npl {npl}", batched_tps("ours", shape, device, npl, ours_k, REPLAY_SHARE),
                batched_tps("llama.cpp", shape, device, npl, llama_cpp_kernels(shape, npl), REPLAY_SHARE))
        tg = {e: 1e3 / step_seconds(e, shape, device, 1, SINGLE_TG // 2, k, REPLAY_SHARE)["step_ms"]
              for e, k in (("ours", ours_k), ("llama.cpp", llama_cpp_kernels(shape, 1)))}
        row("single-stream tg t/s", f"tg{SINGLE_TG}", tg["ours"], tg["llama.cpp"])
        pp = SINGLE_PP / prefill_seconds(shape, device, SINGLE_PP)
        row("single-stream pp t/s", f"pp{SINGLE_PP}", pp, pp)
        for n_parallel, kvu in ((8, False), (32, True)):   # chat_trace.py's rows: peers.peer_label
            row("chat tokens/s", f"t=0.7, llama-server -np {n_parallel}" + (" -kvu" if kvu else ""),
                chat_tps("ours", shape, device, ours_k, REPLAY_SHARE, CHAT_REQUESTS),
                chat_tps("llama.cpp", shape, device, llama_cpp_kernels(shape, n_parallel), REPLAY_SHARE, n_parallel))
        for npl in BATCHED_NPL:
            parts = {e: step_seconds(e, shape, device, npl, NPP + NTG // 2, k, REPLAY_SHARE)
                     for e, k in (("ours", ours_k), ("llama.cpp", llama_cpp_kernels(shape, npl)))}
            row("step ms (lower is better)", f"npl {npl}", parts["ours"]["step_ms"], parts["llama.cpp"]["step_ms"],
                "ms")
            rows[-1].update({f"ours {k}": v for k, v in parts["ours"].items() if k != "step_ms"})
    return rows


def gpu_device(name: str) -> str | None:
    """The DEVICES entry an nvidia-smi name belongs to (None: not one we predict)."""
    n = name.upper()
    if "H200" in n:
        return "H200"
    if "H100" in n:
        return "H100 PCIe" if "PCIE" in n else "H100 SXM"
    return None


def prediction_for(table: list[dict], gpu_name: str, model: str, workload: str, setting: str) -> float | None:
    """Our predicted figure for a measured row of device_bench's summary (None: none made)."""
    device = gpu_device(gpu_name)
    for r in table:
        if (r["device"], r["model"], r["workload"], r["setting"]) == (device, model, workload, setting):
            return r["ours"]
    return None


def main(argv=None) -> int:
    """Write bench/results/gpu_predictions.{json,md}."""
    from bench.common.options import add_options
    from bench.common.report import RESULTS_DIR, script_parser, write_results
    ap = script_parser(__doc__)
    add_options(ap, out=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    rows = [r for d in DEVICES for r in predictions(d)]
    constants = {"BW_EFFICIENCY": BW_EFFICIENCY, "LAUNCH_S": LAUNCH_S, "KERNEL_GAP_S": KERNEL_GAP_S,
                 "PREFILL_FLOPS_EFFICIENCY": PREFILL_FLOPS_EFFICIENCY, "HOST_OURS_FIXED_S": _host_ours_fixed(),
                 "HOST_OURS_PER_SEQ_S": HOST_OURS_PER_SEQ_S, "HOST_LLAMA_CPP_S": HOST_LLAMA_CPP_S,
                 "KV_BYTES_OURS": KV_BYTES_OURS, "KV_BYTES_LLAMA_CPP": KV_BYTES_LLAMA_CPP,
                 "REPLAY_SHARE": REPLAY_SHARE}
    columns = ["device", "model", "workload", "setting", "ours", "llama.cpp", "ours / llama.cpp"]
    write_results("gpu_predictions", {"constants": constants}, rows, out_dir=args.out, columns=columns,
                  title="Predicted GPU figures (bench/common/gpu_model.py), before the loan measures them",
                  notes="Constants: " + ", ".join(f"{k} {v:.3g}" for k, v in constants.items()))
    print((RESULTS_DIR / "gpu_predictions.md").read_text() if args.out == str(RESULTS_DIR) else "written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
