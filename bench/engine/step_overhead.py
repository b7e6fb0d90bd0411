"""What one decode step costs as the number of sequences grows, on each of our attention paths
and on llama-batched-bench, in one run; with the graph's node count, its input tensors and
whether steps ran the previous step's graph again.

The device path (GGML's flash attention over pages gathered by slot: what runs on CUDA and
Vulkan) is timed here on the CPU with attention="gather"; its host cost per step is what a GPU
would wait on. The model is shaped like Llama 3.2 1B (16 layers, its 128k vocabulary) with tiny
widths, so per-step overheads are not hidden behind matrix products:

    python -m pyllama_paged.testing.synthetic_gguf --preset llama3.2-1b --n-embd 256 \
        --n-head 4 --n-head-kv 1 --n-ff 256      # written for you when --model is not given
    python -m bench.engine.step_overhead        # bench/results/step_overhead.{json,md,png}

Ours: ModelRunner (the native step, no scheduler or sampling, as llama-batched-bench samples
nothing): npl sequences of --npp prompt tokens each, prefilled, then --ntg decode steps of all
of them; ms per step = decode wall time / ntg. Then the same through LLMEngine (scheduler,
greedy sampling, the Python around a step). llama-batched-bench: T_TG / ntg, the better of
flash attention on and off. --before LIB times our paths again with another build of our library (e.g. the commit
before a change), in a subprocess, for a before/after table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, save_npl_figure, script_parser, write_results
from bench.common.peers import llama_cpp_tool

MODELS = Path(__file__).resolve().parents[1] / ".models"
SHAPE = {"n_embd": 256, "n_head": 4, "n_head_kv": 1, "n_ff": 256}


def default_model() -> Path:
    """The tiny-width Llama 3.2 1B file, written on first use."""
    from pyllama_paged.testing import synthetic_gguf
    out = MODELS / "llama3.2-1b-w256.gguf"
    if not out.exists():
        MODELS.mkdir(parents=True, exist_ok=True)
        synthetic_gguf.write(out, "llama3.2-1b", **SHAPE)
    return out


def peer(binary: str, model: str, args) -> dict[int, float]:
    """llama-batched-bench's ms per decode step, by npl: the better of flash attention on
    and off (the tool at its best)."""
    from bench.engine.batched import peer as batched_peer   # its command and output parser
    best: dict[int, float] = {}
    for fa in ("on", "off"):
        rows = batched_peer(binary, model, args, extra=["-fa", fa])
        for npl, row in rows.items():
            ms = row["t_tg"] * 1000 / args.ntg
            print(f"llama-batched-bench -fa {fa} npl={npl}: {ms:.2f} ms/step", flush=True)
            best[npl] = min(best.get(npl, ms), ms)
    return best


def runner_steps(model, attention: str, npl: int, args) -> dict:
    """ms per decode step of npl sequences on the native step alone, and the steps' graphs."""
    from pyllama_paged.engine.worker.model_runner import ModelRunner
    from pyllama_paged.engine import EngineConfig
    rng = np.random.default_rng(npl)
    per_seq = args.npp + args.ntg
    blocks = -(-per_seq // args.block_size) + 1   # every sequence whole: the bench never preempts
    runner = ModelRunner(model, EngineConfig(paged=True, n_ctx=per_seq, n_seq_max=npl, n_threads=args.threads,
                                             n_batch=512, block_size=args.block_size, attention=attention,
                                             num_blocks=npl * blocks))
    try:
        seqs = [runner.add_sequence(rng.integers(1000, 50000, size=args.npp).tolist()) for _ in range(npl)]
        for s in seqs:
            runner.prefill(s)
        times, stats = [], []
        for i in range(args.ntg):
            for s in seqs:
                runner.append_tokens(s, [1000 + i])
            t0 = time.perf_counter()
            runner.step([(s, 1) for s in seqs])
            times.append(time.perf_counter() - t0)
            stats.append(runner.step_stats() if hasattr(runner, "step_stats") and _has_stats() else None)
    finally:
        runner.close()
    row = {"ms_per_step": 1000 * sum(times) / len(times), "ms_median": 1000 * float(np.median(times))}
    if stats[0] is not None:
        row.update(nodes=stats[-1]["nodes"], inputs=stats[-1]["inputs"], input_bytes=stats[-1]["input_bytes"],
                   reused=sum(s["reused"] for s in stats) / len(stats))
    return row


def _has_stats() -> bool:
    from pyllama_paged._native import lib
    try:
        lib.pp_context_step_stats
    except AttributeError:   # a build from before the statistics (--before)
        return False
    return True


def engine_steps(model, attention: str, npl: int, args) -> float:
    """ms per decode step through LLMEngine (scheduler, greedy sampling of every sequence)."""
    from pyllama_paged.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
    per_seq = args.npp + args.ntg
    blocks = -(-per_seq // args.block_size) + 1
    config = EngineConfig(n_ctx=per_seq, n_threads=args.threads, n_batch=512, block_size=args.block_size,
                          attention=attention, num_blocks=npl * blocks, n_gpu_layers=args.gpu_layers,
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=npl))
    engine = LLMEngine.from_config(config, model=model, eot_ids=[])
    rng = np.random.default_rng(npl)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.ntg, ignore_eos=True)
        for _ in range(npl):
            engine.add_request(rng.integers(1000, 50000, size=args.npp).tolist(), params)
        while engine.has_work() and engine.num_computed_tokens < npl * args.npp:
            engine.step()
        generated0, t0 = engine.num_generated_tokens, time.perf_counter()
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    return 1000 * wall / max(1, steps)


def ours(model_path: str, args) -> dict:
    from pyllama_paged.engine import Model
    model = Model(model_path, n_gpu_layers=args.gpu_layers)
    out = {}
    try:
        runner_steps(model, "kernel", 1, args)   # warm up: first touches of the weights
        for attention in args.paths:
            for npl in args.npl:
                # the best of --repeats rounds: a busy neighbour only ever slows a round down
                row = min((runner_steps(model, attention, npl, args) for _ in range(args.repeats)),
                          key=lambda r: r["ms_per_step"])
                if not args.runner_only:
                    row["engine_ms_per_step"] = engine_steps(model, attention, npl, args)
                out[f"{attention}/{npl}"] = row
                print(f"ours {attention} npl={npl}: {row}", flush=True)
    finally:
        model.close()
    return out


def before(lib: str, model_path: str, args) -> dict:
    """Our paths timed with another build of the library, in a subprocess."""
    cmd = [sys.executable, __file__, "--model", model_path, "--sides", "ours", "--runner-only", "--json-only",
           "--threads", str(args.threads), "--npp", str(args.npp), "--ntg", str(args.ntg),
           "--block-size", str(args.block_size), "--gpu-layers", str(args.gpu_layers), "--repeats", str(args.repeats),
           "--npl", *map(str, args.npl), "--paths", *args.paths]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYLLAMA_PAGED_LIBRARY": lib}).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--npl", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--paths", nargs="+", default=["kernel", "gather"])
    ap.add_argument("--before", default=None, help="another build of libpyllama_paged.so to time too")
    ap.add_argument("--runner-only", action="store_true", help="skip the LLMEngine timings")
    ap.add_argument("--json-only", action="store_true", help=argparse_hidden())
    add_options(ap, npp=128, ntg=128, threads=1, block_size=16, repeats=3, model=None, gpu_layers=0,
                llama_batched_bench=None, sides="llama.cpp,ours", out=str(RESULTS_DIR),
                helps={"repeats": "rounds of ours per row (the best is kept)",
                       "gpu_layers": "layers on the GPU on both sides (-1: all); a device runs the gather path",
                       "sides": "'ours' alone: no llama.cpp run"})
    args = ap.parse_args(argv)
    model_path = str(args.model or default_model())

    if args.json_only:
        print(json.dumps(ours(model_path, args)))
        return 0
    theirs = peer(llama_cpp_tool("llama-batched-bench", args.llama_batched_bench), model_path, args) \
        if "llama.cpp" in args.sides else {}
    print("llama-batched-bench ms/step:", theirs, flush=True)
    old = before(args.before, model_path, args) if args.before else {}
    mine = ours(model_path, args)

    rows = []
    for attention in args.paths:
        for npl in args.npl:
            o, b = mine[f"{attention}/{npl}"], old.get(f"{attention}/{npl}")
            t = theirs.get(npl)
            rows.append({"path": attention, "npl": npl, "before ms/step": b and b["ms_per_step"],
                         "ms/step": o["ms_per_step"], "engine ms/step": o.get("engine_ms_per_step"),
                         "llama-batched-bench ms/step": t, "ours / llama.cpp (time)": t and o["ms_per_step"] / t,
                         "nodes": o.get("nodes"), "inputs": o.get("inputs"),
                         "input KiB": o.get("input_bytes") and o["input_bytes"] / 1024,
                         "steps reusing the graph": o.get("reused")})
    notes = (f"Model {Path(model_path).name}; npp {args.npp}, ntg {args.ntg}, {args.threads} thread(s), f16 KV, "
             f"block {args.block_size}; ours: the best of {args.repeats} rounds. ms/step: ModelRunner's decode steps of all npl sequences (no sampling, "
             f"as llama-batched-bench); engine ms/step: the same through LLMEngine with greedy sampling. "
             f"'before': --before {args.before}. Target (issue 38): gather at 64 <= llama-batched-bench at 64, "
             f"and the same nodes and inputs at every npl.")
    write_results("step_overhead", {"params": vars(args), "ours": mine, "before": old,
                                    "llama_batched_bench_ms_per_step": theirs},
                  rows, out_dir=args.out, title="Decode step cost by number of sequences", notes=notes)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for attention in args.paths:
        ax.plot(args.npl, [mine[f"{attention}/{n}"]["ms_per_step"] for n in args.npl], "o-", label=f"ours, {attention}")
        if old:
            ax.plot(args.npl, [old[f"{attention}/{n}"]["ms_per_step"] for n in args.npl], "x:",
                    label=f"before, {attention}")
    if theirs:
        ax.plot(args.npl, [theirs[n] for n in args.npl], "s--", label="llama-batched-bench")
    return save_npl_figure(fig, ax, args.npl, "ms per decode step",
                           f"{Path(model_path).name}, {args.threads} thread(s)", Path(args.out) / "step_overhead.png",
                           rows, xlabel="sequences decoded per step")


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
