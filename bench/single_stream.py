"""Single-stream decode and prefill against llama.cpp's own llama-bench, side by side in one
run, with the roofline figures for decode: llama-bench's tg128 (128 tokens generated one at a
time from an empty context) and pp512 (one 512-token prompt), and the same work on our engine
(ModelRunner: the 512 tokens in one chunk; 128 single-token steps, logits of each), best of
--repeats. The roofline: a decode step reads every weight byte once, so its floor is the
weights' bytes over this machine's memory bandwidth (measured here: a NumPy copy of 1 GiB,
bytes read and written); the report gives each side's tokens/s against that ceiling.

    bench/build_llama_cpp.sh
    python bench/single_stream.py --model bench/.models/<file>.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from _report import RESULTS_DIR, markdown_table, write_results

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


def llama_bench(binary: str, model: str, args) -> dict:
    """llama-bench's pp512 and tg128 tokens/s (its JSON output)."""
    cmd = [binary, "-m", model, "-p", str(args.npp), "-n", str(args.ntg), "-t", str(args.threads),
           "-r", str(args.repeats), "-o", "json"]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    out = {}
    for r in rows:
        key = "pp" if r["n_prompt"] and not r["n_gen"] else "tg"
        out[key] = r["avg_ts"]
    return out


def ours(model_path: str, args) -> dict:
    """Our pp and tg tokens/s, best of args.repeats."""
    from pyllama_paged.engine.model import Model
    from pyllama_paged.engine.model_runner import ModelRunner

    model = Model(model_path)
    runner = ModelRunner(model, paged=True, n_ctx=args.npp + args.ntg + 16, n_threads=args.threads,
                         n_batch=args.npp, block_size=16)
    rng = np.random.default_rng(0)
    vocab = model.config.n_vocab
    best = {"pp": 0.0, "tg": 0.0}
    try:
        for r in range(args.repeats + 1):   # the first round warms up
            seq = runner.add_sequence(rng.integers(1000, vocab // 2, size=args.npp).tolist())
            t0 = time.perf_counter()
            runner.step([(seq, args.npp)])
            pp = args.npp / (time.perf_counter() - t0)
            runner.free(seq)
            seq = runner.add_sequence([int(rng.integers(1000, vocab // 2))])
            t0 = time.perf_counter()
            for i in range(args.ntg):
                logits = runner.step([(seq, 1)])
                runner.append_tokens(seq, [int(np.argmax(logits[0]))])
            tg = args.ntg / (time.perf_counter() - t0)
            runner.free(seq)
            if r:
                best = {"pp": max(best["pp"], pp), "tg": max(best["tg"], tg)}
        return {**best, "panel_kernel": model.panel_kernel, "n_panel_packed": model.n_panel_packed}
    finally:
        runner.close()
        model.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--npp", type=int, default=512)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-bench", default=str(BENCH / ".llama.cpp" / "build" / "bin" / "llama-bench"))
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)

    bandwidth = copy_bandwidth()
    theirs = llama_bench(args.llama_bench, args.model, args)
    mine = ours(args.model, args)
    weight_bytes = os.path.getsize(args.model)   # the file is the weights, a few MiB of metadata aside
    ceiling = bandwidth / weight_bytes
    rows = [{"workload": f"pp{args.npp} t/s", "llama-bench": theirs["pp"], "ours": mine["pp"],
             "ours / llama.cpp": mine["pp"] / theirs["pp"], "roofline t/s": None},
            {"workload": f"tg{args.ntg} t/s", "llama-bench": theirs["tg"], "ours": mine["tg"],
             "ours / llama.cpp": mine["tg"] / theirs["tg"], "roofline t/s": ceiling}]
    notes = (f"{args.threads} threads, best of {args.repeats}. Roofline for decode: {weight_bytes / 2**20:.0f} MiB of "
             f"weights read per token over {bandwidth / 1e9:.1f} GB/s (NumPy copy, read + written) = "
             f"{ceiling:.1f} tokens/s; ours reaches {mine['tg'] / ceiling:.0%} of it, llama-bench "
             f"{theirs['tg'] / ceiling:.0%}. Ours: panel kernel {mine['panel_kernel']}, "
             f"{mine['n_panel_packed']} weights in panels.")
    write_results("single_stream", {"params": vars(args), "llama_bench": theirs, "ours": mine,
                                    "copy_bandwidth_bytes_per_s": bandwidth, "weight_bytes": weight_bytes},
                  rows, out_dir=args.out, title="Single stream: decode (tg) and prefill (pp) vs llama-bench",
                  notes=notes)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    for ax, row in zip(axes, rows):
        ax.bar(["llama-bench", "ours"], [row["llama-bench"], row["ours"]], color=["tab:blue", "tab:orange"])
        if row["roofline t/s"]:
            ax.axhline(row["roofline t/s"], color="grey", ls="--", label="bandwidth roofline")
            ax.legend()
        ax.set(title=row["workload"], ylabel="tokens/s")
    fig.suptitle(Path(args.model).name, fontsize=9)
    fig.tight_layout()
    fig.savefig(Path(args.out) / "single_stream.png", dpi=100)
    print(markdown_table(rows))
    print(notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
