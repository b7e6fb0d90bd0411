"""Which constrained-decoding library for the token masks: llguidance or
xgrammar, on the default model's 262,144-token vocabulary.

For each library: the one-time cost of preparing the vocabulary, the cost of
compiling each grammar (JSON object, a JSON schema, a regex), and the cost of
one token mask (fill the bitmask, then consume the token) while walking a
valid answer token by token, which is what every constrained sequence pays
once per step.

Two phases, because xgrammar cannot be installed beside our package without
torch and transformers (its hard dependencies, several GB on Linux):

  python -m bench.kernels.constrain_libraries vocab /tmp/vocab.pkl      # our venv
  python -m bench.kernels.constrain_libraries measure /tmp/vocab.pkl llguidance
  python -m bench.kernels.constrain_libraries measure /tmp/vocab.pkl xgrammar  # a venv with xgrammar --no-deps
  python -m bench.kernels.constrain_libraries report                    # bench/results/constrain_libraries.{json,md}

For the xgrammar run, stand-in `torch`/`transformers` modules are installed in
sys.modules: xgrammar imports both at module level but takes any DLPack array
(numpy's) for the bitmask, so the measured work is its own C++ matcher.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
import types

import numpy as np

from bench.common.report import RESULTS_DIR, write_results

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "tags", "address"],
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
          "tags": ["mathematics", "engines", "poetry of science"],
          "address": {"city": "London", "zip": "W1 4AB"}}
REGEX = r"\d{3}-\d{3}-\d{4} \(([A-Z][a-z]+ ?)+\)"
REGEX_TEXT = "555-867-5309 (Jenny From Accounting)"


def dump_vocab(path: str) -> None:
    from pyllama_paged.engine import Model, default_model_path
    from pyllama_paged.constrain.vocab import vocabulary_bytes
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    model = Model(default_model_path())
    tok = Tokenizer.from_metadata(model.metadata)
    tokens, special = vocabulary_bytes(tok)
    answer = json.dumps(ANSWER, separators=(",", ":"))
    data = {"tokens": tokens, "special": special, "eot": sorted(tok.eot_ids),
            "walks": {"json_object": tok.encode(answer, add_special=False),
                      "json_schema": tok.encode(answer, add_special=False),
                      "regex": tok.encode(REGEX_TEXT, add_special=False)}}
    model.close()
    with open(path, "wb") as f:
        pickle.dump(data, f)


def _walk(fill, consume, walk: list[int]) -> list[float]:
    times = []
    for token in walk:
        t0 = time.perf_counter()
        fill()
        consume(token)
        times.append(time.perf_counter() - t0)
    return times


def measure_llguidance(data: dict) -> dict:
    import llguidance as llg
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    # ours: the same LLTokenizer the server builds (llguidance calls back into our
    # tokenizer while it computes masks, so the vocabulary alone is not enough)
    from pyllama_paged.constrain.vocab import ll_tokenizer
    from pyllama_paged.engine import Model, default_model_path
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    model = Model(default_model_path())
    tok = Tokenizer.from_metadata(model.metadata)
    t0 = time.perf_counter()
    lt = ll_tokenizer(tok)
    prepare = time.perf_counter() - t0
    compact = {"whitespace_flexible": False}   # as the server compiles them (constrain/grammar.py)
    grammars = {"json_object": llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact),
                "json_schema": llg.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=compact),
                "regex": llg.LLMatcher.grammar_from_regex(REGEX)}
    out = {"library": "llguidance", "version": llg.__version__ if hasattr(llg, "__version__") else "",
           "prepare_vocab_s": prepare}
    for name, grammar in grammars.items():
        t0 = time.perf_counter()
        matcher = llg.LLMatcher(lt, grammar)
        compile_s = time.perf_counter() - t0
        assert not matcher.is_error(), matcher.get_error()
        mask = allocate_token_bitmask(1, lt.vocab_size)
        times = _walk(lambda: fill_next_token_bitmask(matcher, mask, 0),
                      lambda t: matcher.consume_token(t) or (_ for _ in ()).throw(AssertionError(name)),
                      data["walks"][name])
        out[name] = {"compile_s": compile_s, "mask_us": [t * 1e6 for t in times]}
    return out


def measure_xgrammar(data: dict) -> dict:
    import tvm_ffi  # noqa: F401  (before the stand-ins: it probes for a real torch)

    torch = types.ModuleType("torch")
    torch.__getattr__ = lambda name: name
    torch.Tensor = torch.LongTensor = torch.FloatTensor = type("Tensor", (), {})
    torch.tensor = lambda *a, **k: None
    sys.modules["torch"] = torch
    transformers = types.ModuleType("transformers")
    transformers.PreTrainedTokenizerBase = transformers.PreTrainedTokenizerFast = \
        transformers.LogitsProcessor = type("Stand-in", (), {})
    sys.modules["transformers"] = transformers
    import xgrammar as xgr

    special = set(data["special"]) - set(data["eot"])
    vocab = [b"" if i in special else t for i, t in enumerate(data["tokens"])]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=data["eot"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    prepare = time.perf_counter() - t0
    makers = {"json_object": lambda: compiler.compile_builtin_json_grammar(),
              "json_schema": lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                  separators=(",", ":")),
              "regex": lambda: compiler.compile_regex(REGEX)}
    out = {"library": "xgrammar", "version": getattr(xgr, "__version__", ""), "prepare_vocab_s": prepare}
    for name, make in makers.items():
        t0 = time.perf_counter()
        matcher = xgr.GrammarMatcher(make())
        compile_s = time.perf_counter() - t0
        mask = np.full((1, (len(vocab) + 31) // 32), -1, dtype=np.int32)
        times = _walk(lambda: matcher.fill_next_token_bitmask(mask, 0),
                      lambda t: matcher.accept_token(t) or (_ for _ in ()).throw(AssertionError(name)),
                      data["walks"][name])
        out[name] = {"compile_s": compile_s, "mask_us": [t * 1e6 for t in times]}
    return out


NOTES = """One sequence, one thread, the default model's vocabulary (Gemma 3, 262,144 tokens), JSON
compiled compact (no free whitespace) by both. *mask+consume*: compute the next-token bitmask,
then consume the token, per token of a valid answer; *compile*: grammar to a ready matcher
(xgrammar's cache off: each request brings its own schema); *vocab prep*: once per model.

**Choice: llguidance.** Per-token masks cost the same for JSON (about 20-25 us), but
llguidance compiles a request's grammar 50-150x faster (under 1 ms against 17-110 ms, paid
by every request with its own schema, before its first token); xgrammar's regex mean is one
31 ms first mask (its median is lower), llguidance's vocabulary preparation is slower (1.3 s,
mostly our Python walk over the vocabulary, once per model). And llguidance has no
dependencies, where xgrammar requires torch, transformers and triton (several GB)
and imports torch at module level (measured here with stand-in modules; see the docstring)."""


def report() -> None:
    """Combine the libraries' raw measurements into bench/results/constrain_libraries.{json,md}."""
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS_DIR.glob("constrain_libraries_*.raw.json"))]
    rows = []
    for r in runs:
        for name in ("json_object", "json_schema", "regex"):
            us = r[name]["mask_us"]
            rows.append({"library": r["library"], "grammar": name, "vocab prep (s)": round(r["prepare_vocab_s"], 3),
                         "compile (ms)": round(r[name]["compile_s"] * 1e3, 2),
                         "mask+consume mean (us)": round(statistics.mean(us), 1),
                         "median (us)": round(statistics.median(us), 1), "max (us)": round(max(us), 1),
                         "tokens walked": len(us)})
    write_results("constrain_libraries", {"runs": runs}, rows,
                  title="Constrained decoding: llguidance vs xgrammar on the 262,144-token vocabulary",
                  notes=NOTES,
                  out_dir=RESULTS_DIR)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__[__doc__.index("Two phases"):])
    phases = ap.add_subparsers(dest="phase", required=True)
    phases.add_parser("vocab", help="dump the default model's vocabulary (our venv)").add_argument("path")
    measure = phases.add_parser("measure", help="time one library on a dumped vocabulary")
    measure.add_argument("path")
    measure.add_argument("library", choices=("llguidance", "xgrammar"))
    phases.add_parser("report", help="combine the measurements into the results' table")
    args = ap.parse_args()
    if args.phase == "vocab":
        dump_vocab(args.path)
    elif args.phase == "measure":
        with open(args.path, "rb") as f:
            data = pickle.load(f)
        lib = args.library
        result = measure_llguidance(data) if lib == "llguidance" else measure_xgrammar(data)
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / f"constrain_libraries_{lib}.raw.json").write_text(json.dumps(result))
        for name in ("json_object", "json_schema", "regex"):
            us = result[name]["mask_us"]
            print(lib, name, f"compile {result[name]['compile_s'] * 1e3:.2f} ms",
                  f"mask mean {statistics.mean(us):.1f} us max {max(us):.1f} us")
    else:
        report()

if __name__ == "__main__":
    main()
