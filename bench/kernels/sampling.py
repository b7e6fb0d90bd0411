"""Sampling cost per step at many sequences: the native batched sampler
(one call per step) against the NumPy sampler it replaced, on the default
model's 262,144-token vocabulary, and as a share of real decode steps.

Part 1 (micro): --rows rows of model-like logits (a peaked head over noise);
each setting is timed over --repeats calls, best of them reported:
native BatchSampler.sample (all rows in one call) vs the NumPy reference
(pyllama_paged/testing/reference/sampling_reference.py, the old per-row algorithm).

Part 2 (in the engine): --rows concurrent greedy-free requests (temperature
0.8, top-p 0.95, top-k 0 and 40) on the default model, 2 threads; the
LLMEngine's own counters split each decode step into forward and sampling.

Outputs: bench/results/sampling.{json,md,png}. Run: python -m bench.kernels.sampling
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.report import markdown_table, save_figure, write_results


SETTINGS = {
    "t0.8 top-p 0.95 top-k 0": dict(temperature=0.8, top_p=0.95, top_k=0, min_p=0.0),
    "t0.8 top-p 0.95 top-k 40": dict(temperature=0.8, top_p=0.95, top_k=40, min_p=0.0),
    "t0.8 top-k 40 min-p 0.05 (Python API default)": dict(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05),
    "greedy": dict(temperature=0.0),
}


def model_like_logits(rng, rows, n_vocab):
    x = rng.standard_normal((rows, n_vocab)).astype(np.float32) * 2.0
    head = rng.integers(0, n_vocab, size=(rows, 20))
    for r in range(rows):
        x[r, head[r]] += rng.uniform(6, 14, size=20)
    return x


def micro(args):
    from pyllama_paged.engine import BatchSampler, Sampler, SamplingParams
    from pyllama_paged.testing.reference.sampling_reference import reference_probs

    rng = np.random.default_rng(0)
    logits = model_like_logits(rng, args.rows, args.vocab)
    sampler = BatchSampler(args.vocab, args.threads)
    rows = []
    for name, kw in SETTINGS.items():
        params = SamplingParams(seed=1, **kw)
        picks = [(i, Sampler(params), []) for i in range(args.rows)]
        native = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            sampler.sample(logits, picks)
            native.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(min(args.rows, 8)):   # the NumPy path, per row as it ran in the step
            probs = reference_probs(logits[i], [], params)
            rng.choice(len(probs), p=probs)
        numpy_per_row = (time.perf_counter() - t0) / min(args.rows, 8)
        rows.append({"setting": name, "rows": args.rows, "native ms/step": 1e3 * min(native),
                     "native us/row": 1e6 * min(native) / args.rows,
                     "numpy ms/step (est.)": 1e3 * numpy_per_row * args.rows,
                     "speedup": numpy_per_row * args.rows / min(native)})
    return rows


# --prompts text: the starts of ordinary English sentences, continued by the model.
TEXT_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "To make a good cup of tea, first warm the pot, then",
    "The main difference between a virus and a bacterium is that",
    "In the morning the fishermen left the harbour and",
    "A balanced diet should include vegetables, grains and",
    "The committee met on Tuesday to discuss the budget, and after a long debate",
    "Photosynthesis is the process by which plants",
    "When I was a child, my grandmother used to tell me",
]


def in_engine(args):
    from pyllama_paged.engine import EngineConfig, LLMEngine, Model, SamplingParams, SchedulerConfig

    model = Model()
    config = EngineConfig(n_ctx=512, n_threads=args.threads, n_batch=512, block_size=32,
                          num_blocks=args.rows * 512 // 32 + 64,
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=args.rows))
    rows = []
    if args.prompts == "text":
        from pyllama_paged.tokenizer.tokenizer import Tokenizer
        tok = Tokenizer.from_metadata(model.metadata)
        texts = [tok.encode(f"{TEXT_PROMPTS[i % len(TEXT_PROMPTS)]} ({i})") for i in range(args.rows)]
    for name in ("t0.8 top-p 0.95 top-k 0", "t0.8 top-p 0.95 top-k 40"):
        llm = LLMEngine.from_config(config, model=model, eot_ids=set())
        rng = np.random.default_rng(1)
        for i in range(args.rows):
            prompt = texts[i] if args.prompts == "text" else [2] + rng.integers(1000, 200000, size=24).tolist()
            llm.add_request(prompt, SamplingParams(max_tokens=args.decode_steps + 1, seed=i, **SETTINGS[name]))
        while any(len(r.seqs[0].output_ids) == 0 for r in llm.requests.values()):
            llm.step()   # prefill
        f0, s0, steps = llm.forward_seconds, llm.sample_seconds, 0
        while llm.has_work() and steps < args.decode_steps:
            llm.step()
            steps += 1
        forward, sample = llm.forward_seconds - f0, llm.sample_seconds - s0
        while llm.has_work():
            llm.step()
        rows.append({"setting": f"{name} ({args.prompts} prompts)", "sequences": args.rows, "decode steps": steps,
                     "forward ms/step": 1e3 * forward / steps, "sampling ms/step": 1e3 * sample / steps,
                     "sampling share of step": sample / (forward + sample)})
        llm.close()
    model.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--prompts", choices=("random", "text"), default="random",
                    help="the engine's prompts: random tokens (flat next-token distributions, the "
                         "default) or English sentences (peaked, as in chat)")
    add_options(ap, repeats=5, threads=2, out=None, helps={"out": "output directory (default: bench/results/)"})
    args = ap.parse_args()
    micro_rows = micro(args)
    print(markdown_table(micro_rows))
    engine_rows = in_engine(args)
    print(markdown_table(engine_rows))
    paths = write_results("sampling", {"micro": micro_rows, "engine": engine_rows, "args": vars(args)},
                          micro_rows + engine_rows, **({"out_dir": Path(args.out)} if args.out else {}))
    plot(micro_rows, engine_rows, paths["json"].with_suffix(".png"))


def plot(micro_rows, engine_rows, path: Path) -> None:
    """Native ms per step by setting, and the sampling share of real decode steps against the 5% bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 3.8))
    names = [r["setting"] for r in micro_rows]
    left.barh(names, [r["native ms/step"] for r in micro_rows], color="tab:blue")
    left.set(xlabel="ms per call", title=f"native sampler: {micro_rows[0]['rows']} rows of 262,144 logits")
    left.invert_yaxis()
    names = [r["setting"] for r in engine_rows]
    right.barh(names, [100 * r["sampling share of step"] for r in engine_rows], color="tab:orange")
    right.axvline(5.0, color="black", linestyle="--", label="bound: 5% of a step")
    right.set(xlabel="% of a decode step", xlim=(0, 10),
              title=f"in the engine: {engine_rows[0]['sequences']} sequences")
    right.invert_yaxis()
    right.legend(loc="upper right")
    save_figure(fig, path)
    plt.close(fig)


if __name__ == "__main__":
    main()
