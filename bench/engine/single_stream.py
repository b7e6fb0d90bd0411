"""Single-stream decode and prefill against llama.cpp's own llama-bench, side by side in one
run, with the roofline figures for decode: llama-bench's tg128 (128 tokens generated one at a
time from an empty context) and pp512 (one 512-token prompt), and the same work on our engine
(ModelRunner: the 512 tokens in one chunk; 128 single-token steps, logits of each), best of
--repeats rounds each, the two sides' rounds interleaved (--sequential: llama-bench's first, for files over half the memory). The roofline (bench/common/roofline.py): a
step reads every weight byte once and does one int8 multiply-accumulate per weight and token, so it takes at least the weights' bytes over
this machine's memory bandwidth (a NumPy copy of 1 GiB, bytes read and written) and at least
its MACs over the int8 peak (bench/kernels/int8_peak.c); the report gives each side's tokens/s against
the ceiling that binds. With --gpu-layers, that many layers on the GPU on both sides (llama-bench's
-ngl, with flash attention on; bench/device_bench.py runs it so on CUDA), and no roofline (it is
this CPU's).

    bench/build_llama_cpp.sh
    python -m bench.engine.single_stream --model bench/.models/<file>.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, markdown_table, save_figure, write_results
from bench.common.peers import LLAMA_CPP_BIN
from bench.common.roofline import copy_bandwidth, int8_peak, model_weights, step_floor_s


def llama_bench(binary: str, model: str, args) -> dict:
    """llama-bench's pp and tg tokens/s, one repetition each (its JSON output)."""
    # llama-bench reads -ngl as llama.h does (negative: every layer), so ours passes through
    # --peer-best: flash attention off and on, the better of the two for each workload
    fa = ["-fa", "on"] if args.gpu_layers else ["-fa", "off,on"] if args.peer_best else []
    cmd = [binary, "-m", model, "-p", str(args.npp), "-n", str(args.ntg), "-t", str(args.threads),
           "-ngl", str(args.gpu_layers), *fa, "-r", "1", "-o", "json"]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    out = {}
    for r in rows:
        key = "pp" if r["n_prompt"] and not r["n_gen"] else "tg"
        out[key] = max(out.get(key, 0.0), r["avg_ts"])
    return out


class Ours:
    """Our engine on the same work: one prompt of npp tokens in one chunk, then ntg single-token
    steps from an empty context, the logits of each (what llama-bench times)."""

    def __init__(self, model_path: str, args):
        from pyllama_paged.engine import EngineConfig, Model
        from pyllama_paged.engine.worker.model_runner import ModelRunner

        self.args = args
        self.model = Model(model_path, n_gpu_layers=args.gpu_layers)
        self.runner = ModelRunner(self.model, EngineConfig(paged=True, n_ctx=args.npp + args.ntg + 16,
                                                           n_threads=args.threads, n_batch=args.npp, block_size=16))
        self.rng = np.random.default_rng(0)
        self.round()   # warms up

    def round(self) -> dict:
        """One pp and one tg measurement, tokens/s."""
        args, runner, vocab = self.args, self.runner, self.model.config.n_vocab
        seq = runner.add_sequence(self.rng.integers(1000, vocab // 2, size=args.npp).tolist())
        t0 = time.perf_counter()
        runner.step([(seq, args.npp)])
        pp = args.npp / (time.perf_counter() - t0)
        runner.free(seq)
        seq = runner.add_sequence([int(self.rng.integers(1000, vocab // 2))])
        t0 = time.perf_counter()
        for _ in range(args.ntg):
            logits = runner.step([(seq, 1)])
            runner.append_tokens(seq, [int(np.argmax(logits[0]))])
        tg = args.ntg / (time.perf_counter() - t0)
        runner.free(seq)
        return {"pp": pp, "tg": tg}

    def close(self) -> None:
        """Free the runner and the model."""
        self.runner.close()
        self.model.close()


def side_by_side(args) -> tuple[dict, dict, list[dict]]:
    """Best of args.repeats rounds for each side, the rounds interleaved (llama-bench, ours,
    llama-bench, ...): this host's memory speed drifts by up to ~15% over minutes, and both
    sides must see the same drift."""
    if args.sequential:
        # a file over half this machine's memory: llama-bench's rounds first, then ours, so the
        # two never hold the weights at once (paired figures pair round i of each side)
        theirs = [llama_bench(args.llama_bench, args.model, args) for _ in range(args.repeats)]
    ours = Ours(args.model, args)
    rounds = []
    try:
        for i in range(args.repeats):
            peer = theirs[i] if args.sequential else llama_bench(args.llama_bench, args.model, args)
            rounds.append({"llama_bench": peer, "ours": ours.round()})
        mine = {"panel_kernel": ours.model.panel_kernel, "n_panel_packed": ours.model.n_panel_packed}
    finally:
        ours.close()
    best = lambda side: {w: max(r[side][w] for r in rounds) for w in ("pp", "tg")}
    return best("llama_bench"), {**best("ours"), **mine}, rounds


def paired_figures(rounds: list[dict], work: str) -> dict:
    """The median of the rounds' ours / llama-bench ratios (each pair ran back to back, under
    the same drift of the host) and each side's spread over the rounds."""
    ratios = [r["ours"][work] / r["llama_bench"][work] for r in rounds]
    spread = lambda side: (lambda v: (max(v) - min(v)) / float(np.median(v)))([r[side][work] for r in rounds])
    return {"paired ratio (median)": float(np.median(ratios)), "spread ours": spread("ours"),
            "spread llama-bench": spread("llama_bench")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    add_options(ap, npp=512, ntg=128, threads=2, repeats=3, gpu_layers=0,
                helps={"gpu_layers": "layers on the GPU on both sides (-1: all; llama-bench then with flash attention on)"})
    ap.add_argument("--llama-bench", default=str(LLAMA_CPP_BIN / "llama-bench"))
    ap.add_argument("--sequential", action="store_true",
                    help="llama-bench's rounds first, then ours (files over half the memory), not interleaved")
    ap.add_argument("--peer-best", action="store_true",
                    help="llama-bench with flash attention off and on, the better for each workload")
    add_options(ap, out=str(RESULTS_DIR))
    args = ap.parse_args(argv)

    theirs, mine, rounds = side_by_side(args)
    rows = [{"workload": f"{w}{n} t/s", "llama-bench": theirs[w], "ours": mine[w],
             "ours / llama.cpp": mine[w] / theirs[w], **paired_figures(rounds, w)}
            for w, n in (("pp", args.npp), ("tg", args.ntg))]
    notes = (f"{args.threads} threads, best of {args.repeats} rounds for each side, "
             f"{'llama-bench first, then ours' if args.sequential else 'interleaved'}"
             f"{'; llama-bench the better of flash attention off and on' if args.peer_best else ''}; the paired "
             "ratio is each round's ours / llama-bench, its median over the rounds; the spreads are each "
             "side's (max - min) / median over the rounds. ")
    roof = {}
    if args.gpu_layers:
        # the roofline below is this CPU's: it bounds nothing on a GPU
        layers = "every layer" if args.gpu_layers < 0 else f"{args.gpu_layers} layers"
        notes += (f"{layers} on the GPU on both sides, llama-bench with flash attention on. "
                  f"Ours: panel kernel {mine['panel_kernel']}, {mine['n_panel_packed']} weights in panels.")
    else:
        bandwidth = copy_bandwidth()
        isa, peak = int8_peak(args.threads)
        weights = model_weights(args.model)   # active parameters: a MoE step reads the experts it picked
        weight_bytes, body, head = weights.step_bytes(1), weights.body_macs, weights.head_macs
        tg_ceiling = 1 / step_floor_s(weight_bytes, body + head, bandwidth, peak)
        # llama-bench's pp and ours both want the last token's logits only
        pp_ceiling = args.npp / step_floor_s(weights.step_bytes(args.npp), args.npp * body + head, bandwidth, peak)
        for row, ceiling in zip(rows, (pp_ceiling, tg_ceiling)):
            row.update({"roofline t/s": ceiling, "ours / roofline": row["ours"] / ceiling})
        roof = {"copy_bandwidth_bytes_per_s": bandwidth, "int8_peak_macs_per_s": peak, "int8_peak_isa": isa,
                "macs_per_token": {"body": body, "head": head}, "weight_bytes": weight_bytes}
        notes += (f"Roofline: {weight_bytes / 2**20:.0f} MiB of weights "
                  f"read per decode step{' (the dense weights and the experts one token picks)' if weights.expert_bytes else ''} over {bandwidth / 1e9:.1f} GB/s (NumPy copy, read + written), and "
                  f"{(body + head) / 1e9:.2f} GMAC per token ({head / 1e9:.2f} of them the head) over an int8 peak of {peak / 1e9:.0f} GMAC/s ({isa}, "
                  f"{args.threads} threads). Decode: memory binds, {tg_ceiling:.1f} tokens/s; ours reaches "
                  f"{mine['tg'] / tg_ceiling:.0%} of it, llama-bench {theirs['tg'] / tg_ceiling:.0%}. Prefill of "
                  f"{args.npp}: compute binds, {pp_ceiling:.0f} tokens/s; ours reaches {mine['pp'] / pp_ceiling:.0%}, "
                  f"llama-bench {theirs['pp'] / pp_ceiling:.0%}. Ours: panel kernel {mine['panel_kernel']}, "
                  f"{mine['n_panel_packed']} weights in panels.")
    write_results("single_stream", {"params": vars(args), "llama_bench": theirs, "ours": mine, "rounds": rounds,
                                    **roof},
                  rows, out_dir=args.out, title="Single stream: decode (tg) and prefill (pp) vs llama-bench",
                  notes=notes)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    for ax, row in zip(axes, rows):
        ax.bar(["llama-bench", "ours"], [row["llama-bench"], row["ours"]], color=["tab:blue", "tab:orange"])
        if row.get("roofline t/s"):
            ax.axhline(row["roofline t/s"], color="grey", ls="--", label="roofline")
            ax.legend()
        ax.set(title=row["workload"], ylabel="tokens/s")
    fig.suptitle(Path(args.model).name, fontsize=9)
    save_figure(fig, Path(args.out) / "single_stream.png")
    print(markdown_table(rows))
    print(notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
