"""Would a GPU replay our decode graphs? GGML 0.20.2's CUDA-graph rule
(pyllama_paged/testing/cuda_graph_replay.py) applied to every step graph our engine builds on the
device path (attention="gather", the argmax node a device's head adds), run on the CPU: no GPU.

Workloads, each on the tiny-width Llama 3.2 1B file (16 layers, 128k vocabulary: the shape of
the issue's 1B file, bench/engine/step_overhead.py writes it) unless --model is given:
- decode: npl sequences of --npp distinct prompt tokens, prefilled, then --ntg decode steps of
  all of them (ModelRunner, as llama-batched-bench's workload): npl 1, 16, 64;
- long: --long-npl sequences of one --long-ctx token prompt (the prefix cache shares its pages),
  then --ntg decode steps (the issue's 64 x 2k case);
- chat: a streaming chat trace through LLMEngine (the scheduler's real batches): --chat-requests
  requests of lognormal prompt and answer lengths, one arriving every --chat-gap steps.

For each: steps, how many would run eagerly, be captured, be replayed, the share replayed, and
the first node that changed for each step that would not replay (with the first node whose shape
changed, when that is a later one). Writes bench/results/graph_replay.{json,md}. Costs no GPU
and no peer; one CPU thread (the step graphs, not their speed, are what is measured).
"""

from __future__ import annotations

import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, markdown_table, script_parser, write_results
from pyllama_paged.testing.cuda_graph_replay import CudaGraphReplay, read_step_graph, replay_summary


def _runner(model, n_ctx: int, n_seqs: int, kv_tokens: int):
    from pyllama_paged.engine import EngineConfig
    from pyllama_paged.engine.worker.model_runner import ModelRunner
    runner = ModelRunner(model, EngineConfig(paged=True, n_ctx=n_ctx, n_seq_max=n_seqs, n_threads=1, n_batch=512,
                                             block_size=32, attention="gather", kv_tokens=kv_tokens))
    runner.set_argmax("always")   # a device holding the head computes its rows' argmax in the graph
    return runner


def decode_outcomes(model, prompts: list[list[int]], ntg: int, n_ctx: int) -> list:
    """Prefill the prompts (one sequence each), then ntg decode steps of all of them: the rule's
    decision for each decode step."""
    runner = _runner(model, n_ctx, len(prompts), len(prompts) * (n_ctx + 32))
    replay = CudaGraphReplay()
    try:
        seqs = []
        for p in prompts:   # one by one: a later prompt's pages may come from the prefix cache
            seqs.append(runner.add_sequence(p))
            runner.prefill(seqs[-1])
        outcomes = []
        for step in range(ntg):
            for s in seqs:
                runner.append_tokens(s, [4 + step % 100])
            runner.step([(s, 1) for s in seqs])
            outcomes.append(replay.observe(read_step_graph(runner)))
        return outcomes
    finally:
        runner.close()


def chat_outcomes(model, n_requests: int, gap: int, n_ctx: int, seed: int) -> tuple[list, int]:
    """A chat trace through LLMEngine: requests of lognormal lengths arriving every `gap` steps;
    the rule's decision for every step that ran a graph, and the steps that ran more than one
    (only the last graph of such a step is seen)."""
    from pyllama_paged.engine import EngineConfig, LLMEngine, SamplingParams
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(300), 0.8, n_requests), 16, n_ctx // 2).astype(int)
    answer_lens = np.clip(rng.lognormal(np.log(64), 0.6, n_requests), 8, n_ctx // 4).astype(int)
    engine = LLMEngine.from_config(EngineConfig(n_ctx=n_ctx, n_threads=1, block_size=32, attention="gather",
                                                kv_tokens=16 * n_ctx, pack_panels=False, repack_weights=False),
                                   model=model, eot_ids=[])
    engine.runner.set_argmax("always")
    replay, outcomes, unseen, step = CudaGraphReplay(), [], 0, 0
    try:
        while step < n_requests * gap or engine.has_work():
            if step % gap == 0 and step // gap < n_requests:
                i = step // gap
                prompt = [int(t) for t in rng.integers(4, model.config.n_vocab, prompt_lens[i])]
                engine.add_request(prompt, SamplingParams(temperature=0.7, max_tokens=int(answer_lens[i]),
                                                          ignore_eos=True, seed=i))
            before = engine.runner.step_stats()["steps"]
            engine.step()
            ran = engine.runner.step_stats()["steps"] - before
            if ran:
                unseen += ran - 1
                outcomes.append(replay.observe(read_step_graph(engine.runner)))
            step += 1
        return outcomes, unseen
    finally:
        engine.close()


def _row(workload: str, setting: str, outcomes: list, **extra) -> dict:
    s = replay_summary(outcomes)
    changes = "; ".join(f"{c['change']} (x{c['steps']})" for c in s["changes"][:4])
    more = len(s["changes"]) - 4
    return {"workload": workload, "setting": setting, "steps": s["steps"], "replayed": s["replay"],
            "captured": s["capture"], "eager": s["eager"], "replay share": s["replay_share"], **extra,
            "first node changed (steps not replayed)": changes + (f"; and {more} more" if more > 0 else "")}


def main(argv=None) -> int:
    """Run the workloads and write the table."""
    from pyllama_paged.engine import Model
    from bench.engine.step_overhead import default_model
    ap = script_parser(__doc__)
    add_options(ap, model=None, npp=128, ntg=256, seed=0, out=str(RESULTS_DIR),
                helps={"model": "GGUF (default: the tiny-width Llama 3.2 1B file)"})
    ap.add_argument("--npl", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--long-npl", type=int, default=64)
    ap.add_argument("--long-ctx", type=int, default=2048, help="0: no long workload")
    ap.add_argument("--chat-requests", type=int, default=24, help="0: no chat trace")
    ap.add_argument("--chat-gap", type=int, default=6)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rows = []
    with Model(args.model or str(default_model()), pack_panels=False, repack_weights=False) as model:
        vocab = model.config.n_vocab
        n_ctx = args.npp + args.ntg + 1
        for npl in args.npl:
            prompts = [[int(t) for t in rng.integers(4, vocab, args.npp)] for _ in range(npl)]
            rows.append(_row("decode", f"npl {npl}, {args.npp} + {args.ntg}", decode_outcomes(model, prompts, args.ntg,
                                                                                           n_ctx)))
            print(markdown_table(rows[-1:]), flush=True)
        if args.long_ctx:
            prompt = [int(t) for t in rng.integers(4, vocab, args.long_ctx)]
            prompts = [prompt[:-1] + [4 + i] for i in range(args.long_npl)]   # shared pages, own last token
            rows.append(_row("decode", f"npl {args.long_npl}, {args.long_ctx} + {args.ntg}",
                             decode_outcomes(model, prompts, args.ntg, args.long_ctx + args.ntg + 1)))
            print(markdown_table(rows[-1:]), flush=True)
        if args.chat_requests:
            outcomes, unseen = chat_outcomes(model, args.chat_requests, args.chat_gap, 2048, args.seed)
            rows.append(_row("chat", f"{args.chat_requests} requests, one per {args.chat_gap} steps", outcomes,
                             **{"steps with an unseen graph": unseen}))
            print(markdown_table(rows[-1:]), flush=True)
    notes = ("GGML 0.20.2's CUDA-graph rule applied to our device path's step graphs, built on the CPU "
             "(pyllama_paged/testing/cuda_graph_replay.py). eager: run node by node (the first call under a key, "
             "or a change); captured: the first unchanged call, captured and launched; replayed: launched from "
             "the capture. A decode step replays unless the graph's shape changed: the attention's key bucket "
             "(a multiple of 64 keys up to 512, then an eighth of the next power of two) or the batch's "
             "sequences.")
    write_results("graph_replay", {"params": vars(args)}, rows, out_dir=args.out,
                  title="Would a GPU replay our step graphs? (GGML 0.20.2's CUDA-graph rule, simulated)", notes=notes)
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
