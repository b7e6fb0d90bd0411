"""Structure-aware fuzzer for the GGUF loading path.

    python -m pyllama_paged.testing.gguf_fuzz --cases 20000 --seed 1 [--workers 2] [--save-dir DIR]
        [--out bench/results/fuzz_gguf.json]
    python -m pyllama_paged.testing.gguf_fuzz --replay '{"seed": "llama-q8_0", "ops": [["truncate", 100]]}'

(From a source checkout's root, `python -P -m ...` keeps the source tree, which has no native
library, off sys.path.)

Every case starts from a tiny valid model (pyllama_paged/testing/reference/tiny_gguf.py) and applies
1-3 mutations (gguf_mutate.py): header counts, metadata types/lengths/
values, array counts, tensor dims/types/offsets/names, truncations, byte flips.
A case passes when opening it — ``Model(path)``, the tokenizer and chat template
from its metadata, the tokenizer's own GGUF reader and, for files that open, a
tokenize/render/one-step forward — either succeeds or raises the project's own
``PagedError`` (``ModelLoadError`` for a bad file). Anything else is a finding:
another exception type ("wrong"), a dead worker ("crash": segfault/abort) or no
answer within --timeout ("hang").

Cases run in long-lived worker processes, one case at a time over a pipe, so a
crash names its case exactly and the worker is restarted. Workers run under an
address-space limit, so a file that makes the loader allocate gigabytes fails
fast as a MemoryError (a finding) instead of swapping. Case i's recipe depends
only on (seed, i), so any run replays exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from . import gguf_mutate as mut

# --------------------------------------------------------------------------- seeds

# Small enough that a load takes milliseconds: one layer, 32-wide rows, the
# minimum vocabulary (specials + 256 byte tokens + a few pieces).
_TINY = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64)
_TEMPLATE = ("{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def _bpe_vocab_ops(n_vocab: int) -> list[list]:
    """Recipe turning a seed's SentencePiece vocabulary into a byte-level BPE one."""
    from pyllama_paged.tokenizer.bpe import BYTE_TO_CHAR

    words = ["Ġt", "he", "Ġthe", "ll", "Ġhe", "Ġhell", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tokens = list(BYTE_TO_CHAR) + words
    tokens += [f"[PAD{i}]" for i in range(n_vocab - len(tokens))]
    types = [1] * len(tokens)
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        types[tokens.index(special)] = 3
    return [
        ["kv", "tokenizer.ggml.model", mut.STRING, "gpt2"],
        ["kv", "tokenizer.ggml.pre", mut.STRING, "qwen2"],
        ["kv", "tokenizer.ggml.tokens", mut.ARRAY, {"etype": mut.STRING, "items": tokens}],
        ["kv", "tokenizer.ggml.token_type", mut.ARRAY, {"etype": mut.I32, "items": types}],
        ["kv", "tokenizer.ggml.merges", mut.ARRAY,
         {"etype": mut.STRING, "items": ["Ġ t", "h e", "Ġt he", "l l", "Ġ he", "Ġhe ll"]}],
        ["kv", "tokenizer.ggml.bos_token_id", mut.U32, tokens.index("<|endoftext|>")],
        ["kv", "tokenizer.ggml.eos_token_id", mut.U32, tokens.index("<|im_end|>")],
        ["kv_drop", "tokenizer.ggml.scores"],
        ["kv_drop", "tokenizer.ggml.unknown_token_id"],
        ["kv", "tokenizer.chat_template", mut.STRING,
         "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
         "{% endfor %}"],
    ]


SEED_SPECS = {
    # name: (write_tiny_model arguments, recipe applied to the written file)
    "llama-q8_0": (dict(arch="llama", weight_type="q8_0", **_TINY), []),
    "gemma3-f16": (dict(arch="gemma3", weight_type="f16", head_dim=16, **_TINY),
                   [["kv", "tokenizer.chat_template", mut.STRING, _TEMPLATE]]),
    "qwen2-q4_0": (dict(arch="qwen2", weight_type="q4_0", **_TINY), []),
    # Q4_K needs 256-long rows: ffn_down's (n_ff) are, the rest fall back to Q8_0.
    "qwen3-q4_k-bpe": (dict(arch="qwen3", weight_type="q4_k", head_dim=16, n_vocab=300,
                            **{**_TINY, "n_ff": 256}), _bpe_vocab_ops(300)),
    # a Gated DeltaNet hybrid (tiny_qwen35.py): ssm.* keys, layer kinds, IMRoPE sections, F32 kernels
    "qwen35-f16": (dict(arch="qwen35", weight_type="f16", n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_rot=8,
                        rope_sections=(2, 1, 1, 0), n_ff=64, d_state=16, n_k_heads=1, n_v_heads=2, n_vocab=320),
                   []),
}
HYBRID_SEEDS = ("qwen35", "qwen35moe")   # written by tiny_qwen35.write_tiny_qwen35


def make_seeds(directory: str | os.PathLike) -> dict[str, mut.Doc]:
    """Write the seed models into directory and parse them (deterministic)."""
    from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
    from pyllama_paged.testing.reference.tiny_qwen35 import write_tiny_qwen35

    docs = {}
    for name, (kwargs, ops) in SEED_SPECS.items():
        path = Path(directory) / f"seed-{name}.gguf"
        kwargs = dict(kwargs)
        arch = kwargs.pop("arch")
        (write_tiny_qwen35 if arch in HYBRID_SEEDS else write_tiny_model)(path, arch, **kwargs)
        doc = mut.parse(path.read_bytes())
        if ops:
            doc = mut.parse(mut.build(doc, ops))
        docs[name] = doc
    return docs


def recipe_for(seed: int, index: int, docs: dict[str, mut.Doc], sizes) -> dict:
    rng = random.Random(f"{seed}:{index}")
    return mut.random_recipe(rng, sorted(docs), docs, sizes)


def seed_sizes(docs: dict[str, mut.Doc]) -> dict[str, tuple[int, int]]:
    out = {}
    for name, doc in docs.items():
        buf, _, data_start = mut.write(doc)
        out[name] = (data_start, len(buf))
    return out


# --------------------------------------------------------------------------- the worker

def _exercise(model, tokenizer, template) -> None:
    """Use a model that opened: the first request would do this much."""
    from pyllama_paged.engine.worker.model_runner import ModelRunner
    from pyllama_paged.engine import EngineConfig

    ids = [t for t in tokenizer.encode("Hello the world <|im_end|>", parse_special=True)
           if 0 <= t < model.config.n_vocab][:8] or [0]
    tokenizer.decode(ids)
    template.render([{"role": "user", "content": "hi"}])
    runner = ModelRunner(model, EngineConfig(paged=True, n_ctx=max(1, min(64, model.config.n_ctx_train)), n_threads=1,
                                             n_batch=16, block_size=16))
    try:
        runner.prefill(runner.add_sequence(ids))
    finally:
        runner.close()


def open_case(path: str, exercise: bool) -> dict:
    """Open one case file the way the library does; classify the outcome."""
    from pyllama_paged.tokenizer.chat_template import ChatTemplate
    from pyllama_paged.errors import PagedError
    from pyllama_paged.engine import Model
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    stage = "reader"
    model = None
    try:
        try:
            Tokenizer.from_gguf(path)  # the tokenizer's own metadata reader
        except PagedError:
            pass  # a clean refusal; Model() must still be tried on the same file
        stage = "load"
        model = Model(path)
        stage = "tokenizer"
        tokenizer = Tokenizer.from_metadata(model.metadata)
        stage = "template"
        template = ChatTemplate.for_model(model.metadata, model.config.arch)
        if exercise:
            stage = "exercise"
            _exercise(model, tokenizer, template)
        return {"outcome": "ok"}
    except PagedError as e:
        return {"outcome": "error", "stage": stage, "type": type(e).__name__, "message": str(e)[:300]}
    except BaseException as e:  # noqa: BLE001 - every other type is what we are looking for
        import traceback
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return {"outcome": "wrong", "stage": stage, "type": type(e).__name__, "message": str(e)[:300],
                "where": f"{Path(tb.filename).name}:{tb.lineno}"}
    finally:
        if model is not None:
            model.close()


def worker_main(exercise: bool, mem_limit_mb: int) -> None:
    """Read case paths (JSON lines) on stdin, answer one JSON line each on stdout."""
    import resource
    import warnings

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (GGML, libraries) must not corrupt the replies
    if mem_limit_mb:
        limit = mem_limit_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    warnings.simplefilter("ignore")  # e.g. "unknown BPE pre-tokenizer": expected here
    import pyllama_paged.engine.worker.model  # noqa: F401 - import once, before the first case
    for line in sys.stdin:
        req = json.loads(line)
        replies.write(json.dumps({"id": req["id"], **open_case(req["path"], exercise)}) + "\n")


# --------------------------------------------------------------------------- the runner

class _Worker:
    def __init__(self, exercise: bool, mem_limit_mb: int, log_dir: str):
        self.log = tempfile.NamedTemporaryFile("w+", dir=log_dir, suffix=".log", delete=False)
        args = [sys.executable, "-m", "pyllama_paged.testing.gguf_fuzz", "--worker",
                "--mem-limit-mb", str(mem_limit_mb)]
        if not exercise:
            args.append("--no-exercise")
        # run in log_dir: `-m` puts the working directory first on sys.path, and a source
        # checkout's root would shadow the installed package (which carries the native library)
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1, cwd=log_dir)
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._replies.put(line)
        self._replies.put(None)  # EOF: the worker died

    def run(self, case_id: int, path: str, timeout: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"id": case_id, "path": path}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._died()
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            self.proc.wait()
            return {"outcome": "hang", "message": f"no answer in {timeout} s"}
        if line is None:
            return self._died()
        return json.loads(line)

    def _died(self) -> dict:
        code = self.proc.wait()
        self.log.flush()
        self.log.seek(0)
        tail = self.log.read()[-1500:]
        what = f"signal {-code}" if code < 0 else f"exit status {code}"
        return {"outcome": "crash", "message": f"worker died ({what})", "stderr_tail": tail}

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def _message_kind(message: str) -> str:
    """An error message with paths and numbers blanked, to count distinct checks."""
    message = re.sub(r"\S+\.gguf:?", "<file>", message)
    message = re.sub(r"'[^']*'", "'…'", message)
    return re.sub(r"-?\d+(\.\d+)?", "N", message)[:120]


def run_fuzz(cases: int, seed: int, *, workers: int = 2, exercise: bool = True, timeout: float = 120.0,
             mem_limit_mb: int = 4096, save_dir: str | None = None, recipes: list[dict] | None = None,
             progress: bool = False) -> dict:
    """Run cases (random from seed, or the given recipes); return the summary dict."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fuzz-gguf-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        docs = make_seeds(tmp)
        sizes = seed_sizes(docs)
        if recipes is None:
            jobs = [(i, None) for i in range(cases)]
        else:
            jobs = list(enumerate(recipes))
        todo: queue.Queue = queue.Queue()
        for job in jobs:
            todo.put(job)
        results: dict[int, tuple[dict, dict]] = {}
        lock = threading.Lock()

        def drive(slot: int) -> None:
            worker = _Worker(exercise, mem_limit_mb, tmp)
            try:
                while True:
                    try:
                        i, recipe = todo.get_nowait()
                    except queue.Empty:
                        return
                    recipe = recipe or recipe_for(seed, i, docs, sizes)
                    path = os.path.join(tmp, f"case-{slot}.gguf")
                    data = mut.build(docs[recipe["seed"]], recipe["ops"])
                    with open(path, "wb") as f:
                        f.write(data)
                    res = worker.run(i, path, timeout)
                    if res["outcome"] in ("crash", "hang", "wrong") and save_dir:
                        os.makedirs(save_dir, exist_ok=True)
                        Path(save_dir, f"case-{seed}-{i}.gguf").write_bytes(data)
                        Path(save_dir, f"case-{seed}-{i}.json").write_text(json.dumps({**recipe, **res}))
                    if not worker.alive:
                        worker.close()
                        worker = _Worker(exercise, mem_limit_mb, tmp)
                    with lock:
                        results[i] = (recipe, res)
                        if progress and len(results) % 1000 == 0:
                            print(f"  {len(results)}/{len(jobs)} cases", file=sys.stderr)
            finally:
                worker.close()

        threads = [threading.Thread(target=drive, args=(k,)) for k in range(max(1, workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    outcomes = Counter(res["outcome"] for _, res in results.values())
    failures = [{"case": i, "recipe": recipe, **res} for i, (recipe, res) in sorted(results.items())
                if res["outcome"] in ("crash", "hang", "wrong")]
    kinds = Counter(_message_kind(res["message"]) for _, res in results.values() if res["outcome"] == "error")
    ops = Counter(op[0] for recipe, _ in results.values() for op in recipe["ops"])
    stages = Counter(res.get("stage", "ok") for _, res in results.values())
    summary = {
        "cases": len(results), "seed": seed, "workers": workers, "exercise": exercise,
        "ok_loads": outcomes["ok"], "clean_errors": outcomes["error"], "crashes": outcomes["crash"],
        "hangs": outcomes["hang"], "wrong_exceptions": outcomes["wrong"],
        "elapsed_s": round(time.monotonic() - started, 1),
        "distinct_error_kinds": len(kinds), "top_error_kinds": kinds.most_common(40),
        "operations": dict(ops), "stages": dict(stages), "seeds": sorted(SEED_SPECS),
        "failures": failures[:200],
    }
    if recipes is not None:  # replays: every case's outcome, in order
        summary["outcomes"] = [results[i][1] for i in range(len(results))]
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a case counts as a hang")
    ap.add_argument("--mem-limit-mb", type=int, default=4096, help="address-space limit of a worker (0: none)")
    ap.add_argument("--no-exercise", action="store_true", help="only open files, no forward step")
    ap.add_argument("--save-dir", help="write failing cases (.gguf + recipe .json) here")
    ap.add_argument("--replay", help="run one recipe (JSON) or a file of them (one per line)")
    ap.add_argument("--out", help="write the summary JSON here (the benchmarks keep bench/results/fuzz_gguf.json)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(not args.no_exercise, args.mem_limit_mb)
        return 0
    recipes = None
    if args.replay:
        text = Path(args.replay).read_text() if os.path.isfile(args.replay) else args.replay
        recipes = [json.loads(line) for line in text.splitlines() if line.strip()]
    summary = run_fuzz(args.cases, args.seed, workers=args.workers, exercise=not args.no_exercise,
                       timeout=args.timeout, mem_limit_mb=args.mem_limit_mb, save_dir=args.save_dir,
                       recipes=recipes, progress=True)
    keys = ("cases", "ok_loads", "clean_errors", "crashes", "hangs", "wrong_exceptions", "elapsed_s")
    print(json.dumps({k: summary[k] for k in keys}))
    for f in summary["failures"][:20]:
        print(json.dumps(f)[:600])
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    bad = summary["crashes"] + summary["hangs"] + summary["wrong_exceptions"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
