"""Single-stream decode with prompt-lookup speculative decoding, ours with and without
it and llama-server with and without its own n-gram drafting (`--spec-type
ngram-simple`), on prompts where lookup pays (code editing, summarising with quotes)
and where it should not (open chat). One request at a time; decode tokens/s is
(tokens - 1) / (last token - first token), so prefill is left out on both sides.
llama-server gets the prompt as our token ids (the two tokenizers agree on this
model), so both sides decode the same context.

By default the prompts are user turns through the chat template and decoding is
greedy (results/speculative/speculative.*). The default model is a base model:
greedy, it falls into a loop, which lookup drafts best. `--prompt-style completion`
sends raw completion prompts (BOS + text, as Llama.tokenize) and `--sampling ollama`
samples with Ollama's defaults on both sides, one seed per repeat (the same seeds on
both sides); those runs are written as speculative_{style}_{sampling}.*. Every row
has each answer's loop share: the fraction of its tokens in a periodic tail.

`--drafter draft_model` drafts with a second model instead, ours
(`SpeculativeConfig(method="draft_model")`) against llama-server's `-md` with
`--spec-type draft-simple`, both greedy drafters of up to --num-draft-tokens tokens.
By default the target is the default model's F16 export (bench/engine/export_f16.py, cached
in bench/.models/) and the draft the Q4_K_M file it came from: no second real model
shares its tokenizer. Written as speculative_draft_model[_{style}_{sampling}].*.

    bench/build_llama_cpp.sh
    python -m bench.engine.speculative                       # the default model, every prompt
    python -m bench.engine.speculative --kinds code_edit --max-tokens 32 --repeats 1 --sides ours
    python -m bench.engine.speculative --prompt-style completion --sampling ollama --repeats 5
    python -m bench.engine.speculative --drafter draft_model --target T.gguf --draft D.gguf
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.common.options import add_options
from bench.common.peers import LLAMA_CPP_BIN, launch_llama_server
from bench.common.report import RESULTS_DIR, markdown_table, save_figure, write_report
from pyllama_paged.testing.serving import stop_server

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Order:
    order_id: str
    customer: str
    items: list[dict]
    shipped: bool = False

    def total(self) -> float:
        """The order's value: every item's price times its quantity."""
        return sum(item["price"] * item["quantity"] for item in self.items)

    def add_item(self, name: str, price: float, quantity: int = 1) -> None:
        """Add a line to the order."""
        self.items.append({"name": name, "price": price, "quantity": quantity})


def load_orders(path: str) -> list[Order]:
    """Orders from a JSON file holding a list of objects."""
    with open(path) as f:
        return [Order(**row) for row in json.load(f)]


def unshipped_total(orders: list[Order]) -> float:
    """The value of every order not shipped yet."""
    return sum(order.total() for order in orders if not order.shipped)
'''
ARTICLE = (
    "The city council met on Tuesday evening to discuss the new bicycle lanes on Main Street. "
    "Supporters said the lanes had cut the number of accidents by a third since they opened in May. "
    "Shop owners on the street said that deliveries had become harder, because trucks can no longer "
    "stop in front of their doors. The council agreed to add two loading zones near the market square "
    "and to review the lanes again next spring. The mayor said that the city would publish the accident "
    "figures every month so that residents can judge the results for themselves.")
PROMPTS = {
    "code_edit": "Rename the field customer to client everywhere in this code. Reply with the whole "
                 f"updated code only.\n\n```python\n{CODE}```",
    "summarise": "Summarise this article in three sentences, quoting its key sentences word for word.\n\n"
                 + ARTICLE,
    "open_chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
# The same tasks as raw text for a base model to continue (--prompt-style completion).
COMPLETION_PROMPTS = {
    "code_edit": f"Original orders.py:\n```python\n{CODE}```\n\nThe same orders.py with the field customer "
                 "renamed to client everywhere:\n```python\nimport json\n",
    "summarise": f"Article:\n{ARTICLE}\n\nThe article's key sentences, quoted word for word:\n1. \"",
    "open_chat": "The old lighthouse keeper had lived alone on the island for thirty years. One morning, "
                 "walking along the shore, he",
}
# Ollama's default options (its DefaultOptions: min_p is unset, so 0); repeat_last_n is
# the penalty window, over the prompt and the answer on both sides.
OLLAMA_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.1,
                   "repeat_last_n": 64}
MAX_LOOP_PERIOD = 64


def chat_ids(model, text: str) -> list[int]:
    """The prompt as the model's chat template renders one user turn, tokenized."""
    from pyllama_paged.tokenizer.chat_template import ChatTemplate
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    template = ChatTemplate.for_model(model.metadata, model.config.arch)
    return Tokenizer.from_metadata(model.metadata).encode(template.render([{"role": "user", "content": text}]),
                                                          parse_special=True)


def completion_ids(model, text: str) -> list[int]:
    """A raw prompt tokenized as Llama.tokenize does: BOS, no special-token parsing."""
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_metadata(model.metadata).encode(text, add_special=True)


def loop_share(tokens: list[int], max_period: int = MAX_LOOP_PERIOD) -> float:
    """The fraction of tokens in the answer's periodic tail: the longest suffix that
    repeats with some period p <= max_period at least twice (length >= 2p); 0 if none."""
    n, longest = len(tokens), 0
    for p in range(1, min(max_period, n // 2) + 1):
        i = n - p - 1   # the suffix is p-periodic back to i + 1: t[j] == t[j + p] for j > i
        while i >= 0 and tokens[i] == tokens[i + p]:
            i -= 1
        length = n - 1 - i
        if length >= 2 * p:
            longest = max(longest, length)
    return longest / n if n else 0.0


def run_ours(model, prompt: list[int], args, speculative, seed: int | None) -> dict:
    """One request alone on a fresh engine (greedy, or Ollama's sampling with seed):
    decode tokens/s and the draft counters."""
    from pyllama_paged.engine import EngineConfig, LLMEngine, SamplingParams

    if args.sampling == "ollama":
        o = OLLAMA_SAMPLING
        params = SamplingParams(max_tokens=args.max_tokens, temperature=o["temperature"], top_k=o["top_k"],
                                top_p=o["top_p"], min_p=o["min_p"], repeat_penalty=o["repeat_penalty"],
                                penalty_last_n=o["repeat_last_n"], seed=seed)
    else:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    config = EngineConfig(n_ctx=args.ctx, n_threads=args.threads, speculative=speculative)
    engine = LLMEngine.from_config(config, model=model)
    try:
        request = engine.add_request(prompt, params)
        first = None
        while engine.has_work():
            engine.step()
            if first is None and request.seqs[0].output_ids:
                first, first_count = time.perf_counter(), len(request.seqs[0].output_ids)
        end = time.perf_counter()
        output = list(request.seqs[0].output_ids)
        n = len(output)
        stats = engine.stats()
        return {"tokens": n, "decode_tokens_per_s": (n - first_count) / (end - first) if n > first_count else 0.0,
                "drafted": stats.get("spec_draft_tokens", 0), "accepted": stats.get("spec_accepted_tokens", 0),
                "draft_model_seconds": stats.get("spec_draft_forward_seconds"),
                "steps": stats["steps"], "seed": seed, "loop_share": loop_share(output), "output": output}
    finally:
        engine.close()


def start_llama_server(binary: str, model: str, args, flags: list[str], log: Path):
    """llama-server with one slot and its drafting flags (none: plain decoding)."""
    return launch_llama_server(binary, model, ["-t", str(args.threads), "-c", str(args.ctx), "-np", "1", *flags],
                               log)


def llama_server_peers(args, draft: str | None) -> list[tuple[str, str, list[str]]]:
    """(side, log tag, flags) of each llama-server run: plain, then its drafter. Prompt
    lookup: `ngram-simple` at its default lookup length (12) and at ours (--max-ngram),
    its best of the two; draft model: `draft-simple` drafting greedily from draft."""
    k = ["--spec-draft-n-max", str(args.num_draft_tokens)]
    if draft:
        return [("llama-server", "plain", []),
                ("llama-server + draft model", "draft", ["-md", draft, "--spec-type", "draft-simple", *k])]
    ngram = ["--spec-type", "ngram-simple", *k]
    return [("llama-server", "plain", []), ("llama-server + ngram-simple", "ngram", ngram),
            (f"llama-server + ngram-simple n{args.max_ngram}", f"ngram{args.max_ngram}",
             [*ngram, "--spec-ngram-simple-size-n", str(args.max_ngram)])]


def run_llama_server(url: str, prompt: list[int], args, seed: int | None) -> dict:
    """One /completion of the same token ids (greedy, or Ollama's sampling with seed):
    llama-server's own decode timing."""
    body = {"prompt": prompt, "n_predict": args.max_tokens, "cache_prompt": False, "return_tokens": True}
    if args.sampling == "ollama":
        body.update(OLLAMA_SAMPLING, seed=seed)
    else:
        body.update(temperature=0, top_k=1)
    r = httpx.post(f"{url}/completion", json=body, timeout=600).json()
    t = r.get("timings", {})
    output = r.get("tokens") or []
    return {"tokens": t.get("predicted_n"), "decode_tokens_per_s": t.get("predicted_per_second"),
            "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0), "seed": seed,
            "loop_share": loop_share(output) if output else None, "output": output}


def plot(path: Path, rows: list[dict], mode: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["prompt"] for r in rows))
    sides = list(dict.fromkeys(r["side"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(sides))
    for j, side in enumerate(sides):
        values = [next((r["decode tok/s"] for r in rows if r["prompt"] == k and r["side"] == side), 0) or 0
                  for k in kinds]
        ax.bar([i + j * width for i in range(len(kinds))], values, width, label=side)
    ax.set_xticks([i + width * (len(sides) - 1) / 2 for i in range(len(kinds))], kinds)
    ax.set_ylabel(f"decode tokens/s (one stream, {mode})")
    ax.legend()
    save_figure(fig, path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=("prompt_lookup", "draft_model"), default="prompt_lookup",
                    help="draft_model: --target drafted by --draft, ours and llama-server's -md")
    ap.add_argument("--model", "--target", dest="model", default=None,
                    help="GGUF (default: the embedded Gemma 3 270M; with --drafter draft_model its F16 export, "
                         "bench/engine/export_f16.py)")
    ap.add_argument("--draft", default=None,
                    help="--drafter draft_model: the draft GGUF (default: the embedded Gemma 3 270M Q4_K_M)")
    ap.add_argument("--kinds", default=",".join(PROMPTS), help="prompts to run: " + ", ".join(PROMPTS))
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-ngram", type=int, default=3)
    add_options(ap, max_tokens=256, threads=2, ctx=2048, repeats=3,
                helps={"repeats": "runs per configuration (the median is kept)"})
    ap.add_argument("--prompt-style", choices=("chat", "completion"), default="chat",
                    help="chat: user turns through the chat template; completion: raw prompts for a base model")
    ap.add_argument("--sampling", choices=("greedy", "ollama"), default="greedy",
                    help="ollama: " + ", ".join(f"{k}={v}" for k, v in OLLAMA_SAMPLING.items())
                    + "; repeat i uses seed --seed + i on both sides")
    add_options(ap, seed=1, sides="ours,llama-server", llama_server=str(LLAMA_CPP_BIN / "llama-server"),
                out_dir=str(RESULTS_DIR), helps={"seed": "the first repeat's seed (--sampling ollama)",
                                                  "llama_server": "llama-server binary"})
    args = ap.parse_args(argv)

    from pyllama_paged.engine import Model, SpeculativeConfig, default_model_path

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft = None
    if args.drafter == "draft_model":
        from bench.common.model_files import default_export   # gguf, needed by this mode alone

        args.model = str(args.model or default_export())
        draft = args.draft = str(args.draft or default_model_path())
    elif args.draft:
        ap.error("--draft is for --drafter draft_model")
    model = Model(args.model)
    model_path = str(model.path)
    kinds = [k for k in args.kinds.split(",") if k]
    if args.prompt_style == "completion":
        prompts = {k: completion_ids(model, COMPLETION_PROMPTS[k]) for k in kinds}
    else:
        prompts = {k: chat_ids(model, PROMPTS[k]) for k in kinds}
    sampled = args.sampling != "greedy"
    seeds = [args.seed + i if sampled else None for i in range(args.repeats)]
    name = "speculative" if draft is None else "speculative_draft_model"
    if (args.prompt_style, args.sampling) != ("chat", "greedy"):
        name += f"_{args.prompt_style}_{args.sampling}"
    if draft:
        spec = SpeculativeConfig(method="draft_model", draft_model=draft, num_draft_tokens=args.num_draft_tokens)
        spec_side = "ours + draft model"
    else:
        spec = SpeculativeConfig(num_draft_tokens=args.num_draft_tokens, max_ngram=args.max_ngram)
        spec_side = "ours + prompt lookup"
    sides = args.sides.split(",")
    runs: dict[str, list[dict]] = {}

    def keep(side: str, kind: str, result: dict) -> None:
        runs.setdefault(f"{side}|{kind}", []).append(result)

    if "ours" in sides:
        for seed in seeds:
            for kind, prompt in prompts.items():
                keep("ours", kind, run_ours(model, prompt, args, None, seed))
                keep(spec_side, kind, run_ours(model, prompt, args, spec, seed))
    model.close()
    if "llama-server" in sides and Path(args.llama_server).exists():
        for side, tag, flags in llama_server_peers(args, draft):
            proc, url = start_llama_server(args.llama_server, model_path, args, flags, out_dir / f"{name}_{tag}.log")
            try:
                for seed in seeds:
                    for kind, prompt in prompts.items():
                        keep(side, kind, run_llama_server(url, prompt, args, seed))
            finally:
                stop_server(proc)

    rows = []
    for key, results in runs.items():
        side, kind = key.split("|")
        speeds = [r["decode_tokens_per_s"] for r in results if r["decode_tokens_per_s"]]
        drafted = sum(r["drafted"] or 0 for r in results)
        loops = [r["loop_share"] for r in results if r["loop_share"] is not None]
        rows.append({"prompt": kind, "side": side, "prompt tokens": len(prompts[kind]),
                     "tokens": statistics.median_low(r["tokens"] or 0 for r in results),
                     "decode tok/s": statistics.median(speeds) if speeds else None,
                     "acceptance": sum(r["accepted"] or 0 for r in results) / drafted if drafted else None,
                     "loop share": statistics.median(loops) if loops else None,
                     "loop share max": max(loops) if loops else None})
    for row in rows:   # each side against our plain decode of the same prompt
        base = next((r["decode tok/s"] for r in rows if r["prompt"] == row["prompt"] and r["side"] == "ours"), None)
        row["x ours plain"] = row["decode tok/s"] / base if base and row["decode tok/s"] else None
    same = all(a["output"] == b["output"] for kind in kinds
               for a, b in zip(runs.get(f"ours|{kind}", []), runs.get(f"{spec_side}|{kind}", [])))
    if sampled:
        mode = "sampled with Ollama's defaults"
        options = ", ".join(f"{k} {v}" for k, v in OLLAMA_SAMPLING.items())
        how = (f"Sampled with Ollama's defaults on both sides ({options}), seeds {seeds[0]}..{seeds[-1]}, "
               "one per repeat, the same on both sides")
    else:
        mode, how = "greedy", "Greedy"
    style = "raw completion prompts (BOS + text)" if args.prompt_style == "completion" else \
        "user turns through the chat template"
    if draft:
        drafting = (f"target {Path(model_path).name} drafted greedily by {Path(draft).name} (ours: "
                    f"`SpeculativeConfig(method=\"draft_model\")`; llama-server: `-md DRAFT --spec-type draft-simple "
                    f"--spec-draft-n-max {args.num_draft_tokens}`)")
        title = "Speculative decoding with a draft model"
    else:
        drafting = (f"ours: n-grams of {args.max_ngram} down to 1; llama-server: `--spec-type ngram-simple "
                    f"--spec-draft-n-max {args.num_draft_tokens}`, with its default lookup n-gram of 12 and with "
                    f"`--spec-ngram-simple-size-n {args.max_ngram}`")
        title = "Speculative decoding by prompt lookup"
    notes = (f"{how}; {style}; one stream, {args.threads} threads, up to {args.max_tokens} tokens, median of "
             f"{args.repeats}; drafts of up to {args.num_draft_tokens} tokens ({drafting}). "
             f"Loop share: the fraction of an answer's tokens in its periodic tail (the longest suffix repeating "
             f"with a period of at most {MAX_LOOP_PERIOD} tokens at least twice), median and max over the repeats. "
             f"Our answers with and without speculation identical{' (per seed)' if sampled else ''}: {same}.")
    print(markdown_table(rows))
    return write_report(name, args, {"runs": runs, "answers_identical": same}, rows, out_dir=out_dir,
                        title=f"{title}: single-stream decode, {mode}", notes=notes,
                        plot=lambda path: plot(path, rows, mode))


if __name__ == "__main__":
    sys.exit(main())
