"""Single-stream decode with prompt-lookup speculative decoding, ours with and without
it and llama-server with and without its own n-gram drafting (`--spec-type
ngram-simple`), on prompts where lookup pays (code editing, summarising with quotes)
and where it should not (open chat). Greedy, one request at a time; decode tokens/s
is (tokens - 1) / (last token - first token), so prefill is left out on both sides.
llama-server gets the prompt as our token ids (the two tokenizers agree on this
model), so both sides decode the same context.

    bench/build_llama_cpp.sh
    python bench/speculative.py                       # the default model, every prompt
    python bench/speculative.py --kinds code_edit --max-tokens 32 --repeats 1 --sides ours
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from _report import RESULTS_DIR, markdown_table, write_results
from pyllama_paged.testing.serving import free_port, stop_server, wait_healthy

BENCH = Path(__file__).resolve().parent

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


def chat_ids(model, text: str) -> list[int]:
    """The prompt as the model's chat template renders one user turn, tokenized."""
    from pyllama_paged.tokenizer.chat_template import ChatTemplate
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    template = ChatTemplate.for_model(model.metadata, model.config.arch)
    return Tokenizer.from_metadata(model.metadata).encode(template.render([{"role": "user", "content": text}]),
                                                          parse_special=True)


def run_ours(model, prompt: list[int], args, speculative) -> dict:
    """One greedy request alone on a fresh engine: decode tokens/s and the draft counters."""
    from pyllama_paged.engine.config import EngineConfig
    from pyllama_paged.engine.llm_engine import LLMEngine
    from pyllama_paged.engine.sampler import SamplingParams

    config = EngineConfig(n_ctx=args.ctx, n_threads=args.threads, speculative=speculative)
    engine = LLMEngine.from_config(config, model=model)
    try:
        request = engine.add_request(prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0))
        first = None
        while engine.has_work():
            engine.step()
            if first is None and request.seqs[0].output_ids:
                first, first_count = time.perf_counter(), len(request.seqs[0].output_ids)
        end = time.perf_counter()
        n = len(request.seqs[0].output_ids)
        stats = engine.stats()
        return {"tokens": n, "decode_tokens_per_s": (n - first_count) / (end - first) if n > first_count else 0.0,
                "drafted": stats.get("spec_draft_tokens", 0), "accepted": stats.get("spec_accepted_tokens", 0),
                "steps": stats["steps"], "output": request.seqs[0].output_ids}
    finally:
        engine.close()


def start_llama_server(binary: str, model: str, args, spec: bool, log: Path):
    """llama-server with one slot, its n-gram drafter on or off."""
    port = free_port()
    extra = ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(args.num_draft_tokens)] if spec else []
    proc = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t",
                             str(args.threads), "-c", str(args.ctx), "-np", "1", *extra],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, "/health", log=log)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


def run_llama_server(url: str, prompt: list[int], args) -> dict:
    """One greedy /completion of the same token ids: llama-server's own decode timing."""
    body = {"prompt": prompt, "n_predict": args.max_tokens, "temperature": 0, "cache_prompt": False,
            "top_k": 1}
    r = httpx.post(f"{url}/completion", json=body, timeout=600).json()
    t = r.get("timings", {})
    return {"tokens": t.get("predicted_n"), "decode_tokens_per_s": t.get("predicted_per_second"),
            "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0)}


def plot(path: Path, rows: list[dict]) -> None:
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
    ax.set_ylabel("decode tokens/s (one stream, greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--kinds", default=",".join(PROMPTS), help="prompts to run: " + ", ".join(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration (the median is kept)")
    ap.add_argument("--sides", default="ours,llama-server")
    ap.add_argument("--llama-server", default=str(BENCH / ".llama.cpp" / "build" / "bin" / "llama-server"))
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)

    from pyllama_paged.engine.model import Model
    from pyllama_paged.engine.spec_draft import SpeculativeConfig

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = Model(args.model)
    model_path = str(model.path)
    kinds = [k for k in args.kinds.split(",") if k]
    prompts = {k: chat_ids(model, PROMPTS[k]) for k in kinds}
    spec = SpeculativeConfig(num_draft_tokens=args.num_draft_tokens, max_ngram=args.max_ngram)
    sides = args.sides.split(",")
    runs: dict[str, list[dict]] = {}

    def keep(side: str, kind: str, result: dict) -> None:
        runs.setdefault(f"{side}|{kind}", []).append(result)

    if "ours" in sides:
        for _ in range(args.repeats):
            for kind, prompt in prompts.items():
                keep("ours", kind, run_ours(model, prompt, args, None))
                keep("ours + prompt lookup", kind, run_ours(model, prompt, args, spec))
    model.close()
    if "llama-server" in sides and Path(args.llama_server).exists():
        for drafting, side in ((False, "llama-server"), (True, "llama-server + ngram-simple")):
            proc, url = start_llama_server(args.llama_server, model_path, args, drafting,
                                           out_dir / f"speculative_{'ngram' if drafting else 'plain'}.log")
            try:
                for _ in range(args.repeats):
                    for kind, prompt in prompts.items():
                        keep(side, kind, run_llama_server(url, prompt, args))
            finally:
                stop_server(proc)

    rows = []
    for key, results in runs.items():
        side, kind = key.split("|")
        speeds = [r["decode_tokens_per_s"] for r in results if r["decode_tokens_per_s"]]
        drafted = sum(r["drafted"] or 0 for r in results)
        rows.append({"prompt": kind, "side": side, "prompt tokens": len(prompts[kind]),
                     "tokens": results[-1]["tokens"],
                     "decode tok/s": statistics.median(speeds) if speeds else None,
                     "acceptance": sum(r["accepted"] or 0 for r in results) / drafted if drafted else None})
    for row in rows:   # each side against our plain decode of the same prompt
        base = next((r["decode tok/s"] for r in rows if r["prompt"] == row["prompt"] and r["side"] == "ours"), None)
        row["x ours plain"] = row["decode tok/s"] / base if base and row["decode tok/s"] else None
    same = all(a["output"] == b["output"] for kind in kinds
               for a, b in zip(runs.get(f"ours|{kind}", []), runs.get(f"ours + prompt lookup|{kind}", [])))
    notes = (f"Greedy, one stream, {args.threads} threads, up to {args.max_tokens} tokens, median of "
             f"{args.repeats}; drafts of up to {args.num_draft_tokens} tokens (ours: n-grams of {args.max_ngram} "
             f"down to 1; llama-server: `--spec-type ngram-simple --spec-draft-n-max {args.num_draft_tokens}`). "
             f"Our answers with and without speculation identical: {same}.")
    write_results("speculative", {"params": vars(args), "runs": runs, "answers_identical": same}, rows,
                  out_dir=out_dir, title="Speculative decoding by prompt lookup: single-stream decode",
                  notes=notes)
    plot(out_dir / "speculative.png", rows)
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
