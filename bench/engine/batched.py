"""llama-batched-bench's workload on our engine and on llama.cpp's own
llama-batched-bench, side by side in one run: npl parallel sequences, each a
--npp-token prompt (its own tokens: nothing shared) then --ntg generated
tokens; total throughput = all prompt and generated tokens / wall time.

Ours: LLMEngine (scheduler, paged KV, batched forward and greedy sampling of
every sequence each step, exactly as the server runs it), npl requests added
at once, stepped to completion, `ignore_eos`. llama-batched-bench decodes a
fixed token without sampling, so our numbers carry the sampling it skips.
Both: --threads threads, physical batch (ubatch) 512, f16 KV; with --gpu-layers, that
many layers on the GPU on both sides, llama-batched-bench with flash attention on
(bench/device_bench.py runs it so on CUDA).

    bench/build_llama_cpp.sh   # once
    python -m bench.engine.batched    # writes bench/results/batched.{json,md,png}
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, save_npl_figure, script_parser, write_results
from bench.common.peers import gpu_layers_flag, llama_cpp_tool
from bench.common.roofline import batched_ceiling, copy_bandwidth, int8_peak, model_weights


def peer(binary: str, model: str, args, extra=()) -> dict[int, dict]:
    """llama-batched-bench's rows, by npl (extra: more of its flags)."""
    ctx = max(args.npl) * (args.npp + args.ntg)
    # on a GPU llama.cpp runs at its best with flash attention; extra may choose otherwise
    flash = ["-fa", "on"] if args.gpu_layers and "-fa" not in extra else []
    cmd = [binary, "-m", model, "-c", str(ctx), "-b", "2048", "-ub", "512", "-t", str(args.threads),
           "-npp", str(args.npp), "-ntg", str(args.ntg), "-npl", ",".join(map(str, args.npl)),
           "-ngl", gpu_layers_flag(args.gpu_layers), *flash, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = {}
    # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[0]):
            pp, tg, b, n_kv, t_pp, s_pp, t_tg, s_tg, t, s = cells
            rows[int(b)] = {"t_pp": float(t_pp), "s_pp": float(s_pp), "t_tg": float(t_tg), "s_tg": float(s_tg),
                            "t": float(t), "s": float(s)}
    if not rows:
        raise RuntimeError("no rows in llama-batched-bench's output:\n" + out[-2000:])
    return rows


def ours(model_path: str | None, args) -> dict[int, dict]:
    from pyllama_paged.engine import (EngineConfig, LLMEngine, Model, SamplingParams, SchedulerConfig,
                                      dense_kv_bytes_per_token)

    model = Model(model_path, n_gpu_layers=args.gpu_layers)
    per_seq = args.npp + args.ntg
    # every sequence's tokens in every layer (as llama-batched-bench's -c), plus a little slack:
    # the bench measures speed, never preemption
    per_seq_blocks = -(-per_seq // args.block_size) + 1
    config = EngineConfig(n_ctx=per_seq, n_threads=args.threads, n_batch=512, block_size=args.block_size,
                          n_gpu_layers=args.gpu_layers,
                          kv_bytes=max(args.npl) * per_seq_blocks * args.block_size
                          * dense_kv_bytes_per_token(model.config, "f16"),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=max(args.npl)))
    engine = LLMEngine.from_config(config, model=model, eot_ids=[])
    rng = np.random.default_rng(0)
    n_vocab = model.config.n_vocab
    params = SamplingParams(temperature=0.0, max_tokens=args.ntg, ignore_eos=True)
    # warm up: graph allocation and first touches, outside the clock
    engine.add_request(rng.integers(1000, n_vocab // 2, size=args.npp).tolist(),
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_work():
        engine.step()
    rows = {}
    for npl in args.npl:
        best = None
        for _ in range(args.repeats):
            prompts = [rng.integers(1000, n_vocab // 2, size=args.npp).tolist() for _ in range(npl)]
            t0 = time.perf_counter()
            for p in prompts:
                engine.add_request(p, params)
            t_pp = None
            computed0 = engine.num_computed_tokens
            preempted0 = engine.scheduler.num_preemptions
            while engine.has_work():
                engine.step()
                if t_pp is None and engine.num_computed_tokens - computed0 >= npl * args.npp:
                    t_pp = time.perf_counter() - t0
            t = time.perf_counter() - t0
            if engine.num_generated_tokens and (best is None or t < best["t"]):
                best = {"t": t, "s": npl * (args.npp + args.ntg) / t, "t_pp_approx": t_pp,
                        "forward_s": None, "preemptions": engine.scheduler.num_preemptions - preempted0}
        rows[npl] = best
        print(f"ours npl={npl}: {best['s']:.1f} t/s, {best['preemptions']} preemptions", flush=True)
    engine.close()
    model.close()
    return rows


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--npl", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    add_options(ap, npp=128, ntg=128, threads=2, block_size=16, repeats=1, model=None, gpu_layers=0,
                llama_batched_bench=None, sides="llama.cpp,ours", out=str(RESULTS_DIR),
                helps={"sides": "'ours' alone: no llama.cpp run"})
    args = ap.parse_args(argv)

    from pyllama_paged.engine import default_model_path
    model_path = args.model or default_model_path()
    theirs = {}
    if "llama.cpp" in args.sides:
        theirs = peer(llama_cpp_tool("llama-batched-bench", args.llama_batched_bench), model_path, args)
        print({k: v["s"] for k, v in theirs.items()}, flush=True)
    mine = ours(args.model, args)

    from pyllama_paged import _native
    ggml = _native.ffi.string(_native.lib.pp_ggml_build_info()).decode()
    # the CPU roofline (bench/common/roofline.py): each step reads the weights once, one MAC per weight and token
    roof = None
    if args.gpu_layers == 0:
        bandwidth, (isa, peak) = copy_bandwidth(), int8_peak(args.threads)
        weights = model_weights(model_path)
        roof = {"copy_bandwidth_bytes_per_s": bandwidth, "int8_peak_macs_per_s": peak, "int8_peak_isa": isa,
                **dataclasses.asdict(weights), "weight_bytes": os.path.getsize(model_path),
                "macs_per_token": [weights.body_macs, weights.head_macs]}
    rows = []
    for npl in args.npl:
        t, o = theirs.get(npl), mine.get(npl)
        ceiling = roof and batched_ceiling(weights, npl, args.npp, args.ntg, 512,
                                           roof["copy_bandwidth_bytes_per_s"], roof["int8_peak_macs_per_s"])
        rows.append({"npl": npl, "tokens": npl * (args.npp + args.ntg),
                     "llama-batched-bench s": t and t["t"], "llama-batched-bench t/s": t and t["s"],
                     "ours s": o and o["t"], "ours t/s": o and o["s"],
                     "ours / llama.cpp": (o["s"] / t["s"]) if (o and t) else None,
                     "roofline t/s": ceiling, "ours / roofline": (o["s"] / ceiling) if (o and ceiling) else None})
    notes = (f"npp {args.npp}, ntg {args.ntg}, {args.threads} threads, ubatch 512, f16 KV, "
             f"{args.gpu_layers} GPU layers (-1: all). Total throughput = "
             f"npl x (npp + ntg) / wall time. Ours: LLMEngine with greedy sampling of every sequence each "
             f"step (llama-batched-bench samples nothing), paged, block {args.block_size}; GGML: {ggml}. "
             f"Target: ours / llama.cpp >= 1.0 at every npl.")
    if roof:
        reads = (f"every step reads {roof['weight_bytes'] / 2**20:.0f} MiB of weights" if not weights.expert_bytes else
                 f"every step reads the {weights.dense_bytes / 2**20:.0f} MiB of dense weights and the experts its tokens "
                 f"picked ({weights.n_used} of {weights.n_expert} per token, uniform routing; all of them: "
                 f"{weights.expert_bytes / 2**20:.0f} MiB)")
        notes += (f"\n\nRoofline (bench/common/roofline.py, active parameters): {reads} "
                  f"at {roof['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (NumPy copy) and does "
                  f"{sum(roof['macs_per_token']) / 1e9:.2f} GMAC per token (the head: {roof['macs_per_token'][1] / 1e9:.2f}, "
                  f"for a prompt's last token only) at {roof['int8_peak_macs_per_s'] / 1e9:.0f} "
                  f"GMAC/s ({roof['int8_peak_isa']}, {args.threads} threads); a step takes at least the larger.")
    write_results("batched", {"params": vars(args), "llama_batched_bench": theirs, "ours": mine, "ggml": ggml,
                              "roofline": roof},
                  rows, out_dir=args.out, title="Batched throughput: llama-batched-bench's workload", notes=notes)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    if theirs:
        ax.plot(args.npl, [r["llama-batched-bench t/s"] for r in rows], "o-", label="llama-batched-bench")
    ax.plot(args.npl, [r["ours t/s"] for r in rows], "s-", label="ours (paged, with sampling)")
    if roof:
        ax.plot(args.npl, [r["roofline t/s"] for r in rows], "--", color="grey", label="roofline")
    return save_npl_figure(fig, ax, args.npl, "total tokens/s",
                           f"pp{args.npp} + tg{args.ntg} per sequence, {args.threads} threads",
                           Path(args.out) / "batched.png", rows)


if __name__ == "__main__":
    sys.exit(main())
