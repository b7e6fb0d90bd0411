"""KL divergence from the float64 reference: mean KL(reference || engine) per position over real
English text, for our engine (both attention paths) and for llama.cpp's llama-perplexity, on the
same GGUF and the same tokens, so "as correct as llama.cpp" is a number.

The text (--text, default the GPL-3's text that Debian ships) is tokenized with the model's own
tokenizer and cut into --chunks chunks of --ctx tokens, each a BOS and the next ctx-1 tokens (no
BOS where the model adds none). Each chunk is evaluated from an empty context and, as
llama-perplexity does, only its second half is scored: the logits at positions ctx/2 .. ctx-2, each
predicting the next token (ctx/2 - 1 positions a chunk).

The reference is pyllama_paged/testing/reference/numpy_model.py's forward pass in float64, its head
multiplied here in float64 as well, a slice of the vocabulary at a time; the scored positions' final
states are cached in bench/.cache/kl_divergence/ (keyed by the model file, the reference's source,
the tokens and ctx), since the forward pass is the costly part (about 35 s a 1024-token chunk of
the default model on 2 cores). From them the reference's log-probabilities are written in
llama-perplexity's --kl-divergence-base file format, and llama-perplexity --kl-divergence
evaluates llama.cpp on exactly those tokens against them. Ours (ModelRunner, the engine's own
chunked prefill of --batch tokens, paged, f16 KV) is scored against the same file with the same
formula, and also exactly (float64, every token of the vocabulary): that format keeps each
log-probability to 16 bits over the 16 nats below the best token and leaves out tokens less
likely than e^-16, so the two columns of ours show what the format changes.

Models: --model PATH (repeatable; default the default model, Gemma 3 270M Q4_K_M) and tiny random
models written by pyllama_paged/testing/reference/tiny_gguf.py (--tiny ARCH ..., into bench/.models/;
gpt-oss by tiny_gpt_oss.py, gemma4 and gemma4-moe by tiny_gemma4.py). The reference is the one
testing/reference/loader.py picks for the file's architecture.
llama-perplexity comes from bench/build_llama_cpp.sh.
Outputs: bench/results/kl_divergence/kl_divergence.{json,md,png}.
Run: python -m bench.engine.kl_divergence
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Sequence

import numpy as np

from bench.common.options import add_options
from bench.common.peers import LLAMA_CPP_BIN
from bench.common.report import BENCH_DIR, RESULTS_DIR, markdown_table, save_figure, script_parser, write_report

CACHE_DIR = BENCH_DIR / ".cache" / "kl_divergence"
TINY_DIR = BENCH_DIR / ".models"
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"

# llama-perplexity's --kl-divergence-base format (tools/perplexity/perplexity.cpp): the magic, then
# int32 n_ctx, n_vocab, n_chunk, the chunks' int32 tokens, then per chunk one row per scored
# position: float32 scale and float32 min_log_prob (as four uint16), n_vocab uint16 levels, padded
# to an even count. A level l stands for log-probability scale * l + min_log_prob; the best
# token is level 65535, and everything at or below 16 nats under it is level 0.
BASE_MAGIC = b"_logits_"
LOG_PROB_RANGE = 16.0
LEVELS = 65535
# llama-perplexity leaves a base log-probability at or below this out of the KL sum.
KL_FLOOR = -16.0

ENGINES = ("ours (kernel)", "ours (gather)", "llama.cpp")
ATTENTION_PATHS = {"ours (kernel)": "kernel", "ours (gather)": "gather"}
VOCAB_SLICE = 16384   # head rows multiplied at a time in float64 (16384 x n_embd doubles)
ROW_BLOCK = 64        # scored positions whose full distributions are held at once


# ---- the measure --------------------------------------------------------------------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of each row of logits, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_exact(ref_log_probs: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(reference || engine) of each row, in float64 over the whole vocabulary (nats)."""
    ref = np.asarray(ref_log_probs, dtype=np.float64)
    return (np.exp(ref) * (ref - log_softmax(logits))).sum(axis=-1)


def row_width(n_vocab: int) -> int:
    """uint16 values a base-file row takes: the two float32 in front, the levels, padded even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_positions(ctx: int) -> range:
    """The positions of a chunk llama-perplexity scores: its second half, less the last token."""
    return range(ctx // 2, ctx - 1)


def quantize_log_probs(log_probs: np.ndarray) -> np.ndarray:
    """Base-file rows [n, row_width] of log-probability rows [n, n_vocab] (llama.cpp's encoding)."""
    lp = np.asarray(log_probs, dtype=np.float64)
    n, n_vocab = lp.shape
    best = lp.max(axis=1, keepdims=True)
    low = np.maximum(lp.min(axis=1, keepdims=True), best - LOG_PROB_RANGE)
    scale = (best - low) / LEVELS
    # a flat row (scale 0) is all level 0, as in llama.cpp
    levels = np.where(lp > low, np.rint((lp - low) / np.where(scale > 0, scale, 1.0)), 0.0)
    rows = np.zeros((n, row_width(n_vocab)), dtype=np.uint16)
    header = np.stack([scale[:, 0], low[:, 0]], axis=1).astype(np.float32)
    rows[:, :4] = header.view(np.uint16)
    rows[:, 4:4 + n_vocab] = levels.astype(np.uint16)
    return rows


def dequantize_rows(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """The log-probabilities [n, n_vocab] base-file rows stand for (float32, as llama.cpp reads them)."""
    rows = np.ascontiguousarray(rows, dtype=np.uint16)
    header = rows[:, :4].copy().view(np.float32)
    scale, low = header[:, :1], header[:, 1:2]
    return scale * rows[:, 4:4 + n_vocab].astype(np.float32) + low


@dataclass
class RowScores:
    """Per scored position: KL(reference || engine), whether both put the same token first, and
    the engine's negative log-likelihood of the token that follows."""
    kl: np.ndarray
    same_top: np.ndarray
    nll: np.ndarray


def kl_base_format(rows: np.ndarray, logits: np.ndarray, n_vocab: int, next_tokens: Sequence[int]) -> RowScores:
    """llama-perplexity's --kl-divergence per row: the reference read from base-file rows, terms
    whose base log-probability is at or below KL_FLOOR left out; the top token of each side is
    its first best one."""
    base = dequantize_rows(rows, n_vocab).astype(np.float64)
    engine = log_softmax(logits)
    kept = base > KL_FLOOR
    kl = np.where(kept, np.exp(base) * (base - engine), 0.0).sum(axis=1)
    same_top = np.argmax(np.asarray(logits), axis=1) == np.argmax(base, axis=1)
    nll = -engine[np.arange(len(engine)), np.asarray(next_tokens)]
    return RowScores(kl, same_top, nll)


def kl_exact_scores(ref_log_probs: np.ndarray, logits: np.ndarray, next_tokens: Sequence[int]) -> RowScores:
    """kl_exact per row, with the top tokens compared on the full-precision reference."""
    engine = log_softmax(logits)
    kl = (np.exp(ref_log_probs) * (ref_log_probs - engine)).sum(axis=1)
    same_top = np.argmax(np.asarray(logits), axis=1) == np.argmax(ref_log_probs, axis=1)
    nll = -engine[np.arange(len(engine)), np.asarray(next_tokens)]
    return RowScores(kl, same_top, nll)


# ---- the base file ----------------------------------------------------------------------

def write_base_header(f: BinaryIO, ctx: int, n_vocab: int, chunks: np.ndarray) -> None:
    """The base file's header and tokens; the rows follow, chunk after chunk."""
    chunks = np.asarray(chunks, dtype=np.int32)
    if chunks.ndim != 2 or chunks.shape[1] != ctx:
        raise ValueError(f"chunks must be [n_chunk, {ctx}] token ids")
    f.write(BASE_MAGIC)
    f.write(np.array([ctx, n_vocab, len(chunks)], dtype=np.int32).tobytes())
    f.write(chunks.tobytes())


@dataclass
class BaseFile:
    """A base file read back: its context, vocabulary size, chunks' tokens and rows."""
    ctx: int
    n_vocab: int
    chunks: np.ndarray   # [n_chunk, ctx] int32
    rows: np.ndarray     # [n_chunk, len(scored_positions(ctx)), row_width(n_vocab)] uint16


def read_base_file(path: str | Path) -> BaseFile:
    """Read a --kl-divergence-base file (ours or llama-perplexity's own), rows memory-mapped."""
    with open(path, "rb") as f:
        if f.read(len(BASE_MAGIC)) != BASE_MAGIC:
            raise ValueError(f"{path} is not a llama-perplexity log-probability file")
        ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(f.read(12), dtype=np.int32))
        chunks = np.frombuffer(f.read(4 * ctx * n_chunk), dtype=np.int32).reshape(n_chunk, ctx)
        offset = f.tell()
    n_rows = len(scored_positions(ctx))
    rows = np.memmap(path, dtype=np.uint16, mode="r", offset=offset, shape=(n_chunk, n_rows, row_width(n_vocab)))
    return BaseFile(ctx, n_vocab, chunks.copy(), rows)


# ---- the text and its chunks ----------------------------------------------------------------

def text_chunks(tokenizer, text: str, ctx: int, n_chunks: int) -> np.ndarray:
    """[n_chunks, ctx] token ids: consecutive pieces of the text, each after a BOS where the model
    adds one (llama-perplexity puts the BOS in place of a chunk's first token: here it is one)."""
    ids = tokenizer.encode(text, add_special=False)
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    body = ctx - len(bos)
    if len(ids) < n_chunks * body:
        raise SystemExit(f"the text is {len(ids)} tokens: {n_chunks} chunks of {ctx} need {n_chunks * body}")
    return np.array([bos + ids[i * body:(i + 1) * body] for i in range(n_chunks)], dtype=np.int32)


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


# ---- the reference ---------------------------------------------------------------------

def reference_sources(model_path: str) -> list[str]:
    """The reference's source files that model the file at model_path: numpy_model.py, and the
    module of its own an architecture has (loader.OWN_MODULES: gemma4)."""
    from pyllama_paged.testing.reference import loader, numpy_model

    arch = numpy_model.read_gguf(model_path)[0].get("general.architecture")
    own = loader.OWN_MODULES.get(arch)
    return [numpy_model.__file__] + ([sys.modules[own.__module__].__file__] if own else [])


def reference_states(model_path: str, chunks: np.ndarray) -> tuple[np.ndarray, float]:
    """The float64 reference's final normed states at each chunk's scored positions
    [n_chunk, n_scored, n_embd], cached; and the seconds the forward passes took (0 when cached)."""
    from pyllama_paged.testing.reference.loader import load_reference

    ctx = chunks.shape[1]
    key = hashlib.sha256()
    for part in (file_digest(model_path), *map(file_digest, reference_sources(model_path)), str(ctx)):
        key.update(part.encode())
    key.update(chunks.tobytes())
    cached = CACHE_DIR / f"{Path(model_path).stem}-{key.hexdigest()[:16]}.npy"
    if cached.is_file():
        return np.load(cached), 0.0
    started = time.perf_counter()
    model = load_reference(model_path)
    # the head's logits for every position are not wanted (reference_log_probs multiplies the
    # scored states in float64); if this private hook is renamed the result is unchanged, only slower
    model._head = lambda x, w: np.zeros((len(x), 1))
    scored = scored_positions(ctx)
    states = []
    for i, chunk in enumerate(chunks):
        model.forward(chunk.tolist())
        states.append(np.array(model.last_hidden[scored.start:scored.stop], dtype=np.float64))
        print(f"  reference chunk {i + 1}/{len(chunks)}: {time.perf_counter() - started:.0f} s", flush=True)
    states = np.stack(states)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    np.save(cached.with_suffix(".tmp.npy"), states)
    cached.with_suffix(".tmp.npy").rename(cached)   # never a half-written cache entry
    return states, time.perf_counter() - started


@dataclass
class ReferenceHead:
    """The reference's output head: the weights (output.weight, else the tied embeddings) and
    the final soft-cap, read from the GGUF as the reference reads them."""
    weights: np.ndarray   # [n_vocab, n_embd] float32
    softcap: float | None

    @classmethod
    def from_gguf(cls, path: str) -> "ReferenceHead":
        """The head of the GGUF at path."""
        from pyllama_paged.testing.reference.numpy_model import load_tensor, read_gguf

        meta, infos, mm = read_gguf(path)
        by_name = {info.name: info for info in infos}
        weights = load_tensor(mm, by_name["output.weight" if "output.weight" in by_name else "token_embd.weight"])
        cap = meta.get(f"{meta['general.architecture']}.final_logit_softcapping")
        return cls(weights, float(cap) if cap is not None and float(cap) > 0 else None)

    def log_probs(self, states: np.ndarray) -> np.ndarray:
        """Reference log-probabilities [n, n_vocab] of final states [n, n_embd], all in float64."""
        logits = np.empty((len(states), len(self.weights)))
        for v0 in range(0, len(self.weights), VOCAB_SLICE):
            logits[:, v0:v0 + VOCAB_SLICE] = states @ self.weights[v0:v0 + VOCAB_SLICE].astype(np.float64).T
        if self.softcap is not None:
            logits = self.softcap * np.tanh(logits / self.softcap)
        return log_softmax(logits)


# ---- the engines -----------------------------------------------------------------------

def our_scored_logits(runner, chunk: np.ndarray, batch: int) -> np.ndarray:
    """Our logits [n_scored, n_vocab] at a chunk's scored positions: the chunk prefilled from an
    empty context in steps of `batch` tokens, as the scheduler's chunked prefill runs a prompt."""
    from pyllama_paged.engine.kv.manager import commit_chunks

    ids = chunk.tolist()
    scored = scored_positions(len(ids))
    out = np.empty((len(scored), runner.n_vocab), dtype=np.float32)
    seq = runner.add_sequence_uncached(ids)
    try:
        for start in range(0, len(ids), batch):
            n = min(batch, len(ids) - start)
            wanted = start + n > scored.start
            logits, _ = runner.execute(np.array([[seq.handle, start, n]]), all_logits=[wanted])
            if wanted:
                lo, hi = max(start, scored.start), min(start + n, scored.stop)
                out[lo - scored.start:hi - scored.start] = logits[lo - start:hi - start]
            commit_chunks(runner.kv, [(seq, n)])
    finally:
        runner.free(seq)
    return out


PERPLEXITY_FIELDS = {"mean_kl": r"Mean\s+KLD:\s*([-0-9.eE+]+)", "p99_kl": r"99\.0%\s+KLD:\s*([-0-9.eE+]+)",
                     "same_top_pct": r"Same top p:\s*([-0-9.eE+]+)", "ppl": r"Mean PPL\(Q\)\s*:\s*([-0-9.eE+]+)",
                     "ref_ppl": r"Mean PPL\(base\)\s*:\s*([-0-9.eE+]+)"}


# llama-perplexity prints through llama.cpp's common log, whose worker thread writes the lines
# behind the program; the tool returns from main without flushing it (its own log.h asks callers
# to call common_log_flush before exit), so the summary, printed last, is lost in about half the
# runs. This library, preloaded, flushes the log as the process exits. The names are C++'s.
FLUSH_AT_EXIT_C = r"""
#include <dlfcn.h>
__attribute__((destructor)) static void flush_common_log(void) {
    void *(*main_log)(void) = (void *(*)(void)) dlsym(RTLD_DEFAULT, "_Z15common_log_mainv");
    void (*flush)(void *) = (void (*)(void *)) dlsym(RTLD_DEFAULT, "_Z16common_log_flushP10common_log");
    if (main_log && flush) flush(main_log());
}
"""


def log_flushing_library() -> Path:
    """FLUSH_AT_EXIT_C built once into the cache folder (the system's cc)."""
    lib = CACHE_DIR / "flush_common_log.so"
    if not lib.is_file():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(".tmp")
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-x", "c", "-", "-o", str(tmp), "-ldl"],
                       input=FLUSH_AT_EXIT_C, text=True, check=True)
        tmp.rename(lib)
    return lib


def llama_cpp_scores(binary: str, model_path: str, base: Path, ctx: int, threads: int, log: Path,
                     extra: Sequence[str] = ()) -> dict:
    """llama-perplexity --kl-divergence against our base file: its summary figures, parsed."""
    cmd = [binary, "-m", model_path, "--kl-divergence-base", str(base), "--kl-divergence",
           "-c", str(ctx), "-b", str(ctx), "-t", str(threads), *extra]
    env = {**os.environ, "LD_PRELOAD": str(log_flushing_library())}
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    printed = done.stdout + done.stderr
    log.write_text(printed)
    if done.returncode != 0:
        raise SystemExit(f"llama-perplexity failed ({done.returncode}); see {log}")
    found = {}
    for name, pattern in PERPLEXITY_FIELDS.items():
        m = re.search(pattern, printed)
        if m is None:
            raise SystemExit(f"llama-perplexity printed no '{name}'; see {log}")
        found[name] = float(m.group(1))
    return {**found, "seconds": seconds}


def summary(scores: Sequence[RowScores]) -> dict:
    """Mean and 99th percentile of KL, top-token agreement (%) and perplexity over all positions."""
    kl = np.concatenate([s.kl for s in scores])
    same = np.concatenate([s.same_top for s in scores])
    nll = np.concatenate([s.nll for s in scores])
    # llama-perplexity's percentile: linear between the sorted values, as np.percentile's default
    return {"mean_kl": float(kl.mean()), "p99_kl": float(np.percentile(kl, 99)),
            "same_top_pct": 100.0 * float(same.mean()), "ppl": float(np.exp(nll.mean())), "positions": len(kl)}


# ---- one model ----------------------------------------------------------------------------

def measure_model(model_path: str, text: str, args, work: Path) -> dict:
    """Every engine's figures on one model: ours on both attention paths (base-file formula and
    exact), llama.cpp through llama-perplexity."""
    from pyllama_paged.engine import EngineConfig, Model
    from pyllama_paged.engine.worker.model_runner import ModelRunner
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    name = Path(model_path).name
    print(f"{name}:", flush=True)
    chunks = text_chunks(Tokenizer.from_gguf(model_path), text, args.ctx, args.chunks)
    states, reference_s = reference_states(model_path, chunks)
    head = ReferenceHead.from_gguf(model_path)
    n_vocab = len(head.weights)
    scored = scored_positions(args.ctx)

    model = Model(model_path)
    runners = {engine: ModelRunner(model, EngineConfig(paged=True, n_ctx=args.ctx, n_threads=args.threads,
                                                       n_batch=args.batch, attention=path))
               for engine, path in ATTENTION_PATHS.items()}
    base = work / f"{Path(model_path).stem}.kld-base"
    base_scores: dict[str, list[RowScores]] = {e: [] for e in runners}
    exact_scores: dict[str, list[RowScores]] = {e: [] for e in runners}
    ours_s = dict.fromkeys(runners, 0.0)
    ref_nll = []
    try:
        with open(base, "wb") as f:
            write_base_header(f, args.ctx, n_vocab, chunks)
            for c, chunk in enumerate(chunks):
                logits = {}
                for engine, runner in runners.items():
                    started = time.perf_counter()
                    logits[engine] = our_scored_logits(runner, chunk, args.batch)
                    ours_s[engine] += time.perf_counter() - started
                for r0 in range(0, len(scored), ROW_BLOCK):
                    r1 = min(r0 + ROW_BLOCK, len(scored))
                    ref = head.log_probs(states[c, r0:r1])
                    rows = quantize_log_probs(ref)
                    f.write(rows.tobytes())
                    following = chunk[scored.start + r0 + 1:scored.start + r1 + 1]
                    ref_nll.append(-ref[np.arange(len(ref)), following])   # as llama-perplexity's PPL(base)
                    for engine, got in logits.items():
                        base_scores[engine].append(kl_base_format(rows, got[r0:r1], n_vocab, following))
                        exact_scores[engine].append(kl_exact_scores(ref, got[r0:r1], following))
                print(f"  ours, chunk {c + 1}/{len(chunks)} scored", flush=True)
    finally:
        for runner in runners.values():
            runner.close()
        model.close()
    result = {"model": name, "path": model_path, "n_vocab": n_vocab, "reference_s": reference_s,
              "reference_ppl": float(np.exp(np.concatenate(ref_nll).mean())), "engines": {}}
    for engine in runners:
        result["engines"][engine] = {**summary(base_scores[engine]), "seconds": ours_s[engine],
                                     "exact": summary(exact_scores[engine])}
    if args.llama_perplexity:
        theirs = llama_cpp_scores(args.llama_perplexity, model_path, base, args.ctx, args.threads,
                                  Path(args.out) / f"{Path(model_path).stem}.llama-perplexity.log",
                                  shlex.split(args.llama_args))
        theirs["positions"] = len(scored) * len(chunks)
        result["engines"]["llama.cpp"] = theirs
    base.unlink()
    return result


# --tiny names of gemma4's two tiny shapes (tiny_gemma4.py: sliding and full layers, shared KV,
# per-layer embeddings; experts beside the dense FFN)
GEMMA4_SHAPES = {"gemma4": "dense", "gemma4-moe": "moe"}


def tiny_model(arch: str, weights: str, ctx: int) -> str:
    """A tiny random-weight model of arch (tiny_gguf.py's defaults; gpt-oss and GEMMA4_SHAPES
    from their own writers) in bench/.models/, written again each run (a second): the file
    follows its writer, the reference's cache its bytes."""
    from pyllama_paged.testing.reference.tiny_gemma4 import write_tiny_gemma4
    from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
    from pyllama_paged.testing.reference.tiny_gpt_oss import write_tiny_gpt_oss

    path = TINY_DIR / f"tiny-{arch}-{weights}-ctx{ctx}.gguf"
    TINY_DIR.mkdir(parents=True, exist_ok=True)
    if arch == "gpt-oss":   # its own writer: MXFP4 experts, sinks, YaRN (the context is YaRN's)
        write_tiny_gpt_oss(path.with_suffix(".tmp"), weight_type=weights)
    elif arch in GEMMA4_SHAPES:   # a context of 4096, more than any --ctx here
        write_tiny_gemma4(path.with_suffix(".tmp"), GEMMA4_SHAPES[arch], weight_type=weights)
    else:
        write_tiny_model(path.with_suffix(".tmp"), arch, weight_type=weights, context_length=ctx)
    path.with_suffix(".tmp").rename(path)
    return str(path)


def table_rows(results: Sequence[dict]) -> list[dict]:
    """One row per model and engine: the base-file formula's figures, and ours exactly. KL in
    thousandths of a nat, so that the table keeps three digits of it."""
    def milli(value):
        return None if value is None else 1e3 * value

    rows = []
    for r in results:
        for engine in ENGINES:
            e = r["engines"].get(engine)
            if e is None:
                continue
            exact = e.get("exact", {})
            rows.append({"model": r["model"].removesuffix(".gguf"), "engine": engine, "positions": e["positions"],
                         "mean KL (1e-3 nat)": milli(e["mean_kl"]), "p99 KL (1e-3 nat)": milli(e["p99_kl"]),
                         "same top-1 %": e["same_top_pct"], "PPL": e["ppl"],
                         "exact mean KL (1e-3 nat)": milli(exact.get("mean_kl")),
                         "exact p99 KL (1e-3 nat)": milli(exact.get("p99_kl")),
                         "exact top-1 %": exact.get("same_top_pct")})
    return rows


def plot(results: Sequence[dict], path: Path) -> None:
    """Mean and 99th-percentile KL per model, a bar per engine (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(ENGINES)
    for ax, key, title in zip(axes, ("mean_kl", "p99_kl"), ("mean KL(reference || engine)", "99th percentile")):
        for k, engine in enumerate(ENGINES):
            xs = [i for i, r in enumerate(results) if engine in r["engines"]]
            ax.bar([x + (k - (len(ENGINES) - 1) / 2) * width for x in xs],
                   [results[x]["engines"][engine][key] for x in xs], width, label=engine)
        # the file name's quantization part on a line of its own, so that names do not overlap
        labels = [re.sub(r"-(?=i?q\d|b?f16|f32)", "\n", r["model"].removesuffix(".gguf"), count=1)
                  for r in results]
        ax.set_xticks(range(len(results)), labels, fontsize=7)
        ax.set(title=title, ylabel="nats", yscale="log")
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--model", action="append", help="a GGUF to measure (repeatable; default: the default model)")
    ap.add_argument("--tiny", nargs="*", default=["gemma3", "qwen3", "qwen3moe", "gemma4", "gemma4-moe"],
                    help="tiny_gguf.py architectures, gpt-oss or GEMMA4_SHAPES' names, to write and measure too "
                         "(none: --tiny alone)")
    ap.add_argument("--tiny-weights", default="q8_0", help="the tiny models' weight type")
    ap.add_argument("--text", action="append", help=f"text files, joined (repeatable; default {DEFAULT_TEXT})")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=512, help="our prefill step (the engine's default n_batch)")
    add_options(ap, ctx=1024, threads=2, helps={"ctx": "tokens a chunk (its second half less one is scored)"})
    ap.add_argument("--llama-perplexity", default=str(LLAMA_CPP_BIN / "llama-perplexity"),
                    help="its binary ('' skips llama.cpp)")
    ap.add_argument("--llama-args", default="", help="more llama-perplexity flags, e.g. '-fa off'")
    add_options(ap, out=str(RESULTS_DIR / "kl_divergence"))
    args = ap.parse_args(argv)
    if args.llama_perplexity and not Path(args.llama_perplexity).is_file():
        raise SystemExit(f"{args.llama_perplexity} is not built: run bench/build_llama_cpp.sh")

    from pyllama_paged.engine import default_model_path

    text = "\n\n".join(Path(p).read_text(encoding="utf-8") for p in (args.text or [DEFAULT_TEXT]))
    models = list(args.model or [default_model_path()])
    models += [tiny_model(arch, args.tiny_weights, args.ctx) for arch in args.tiny]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out) as work:
        results = [measure_model(m, text, args, Path(work)) for m in models]
    elapsed = time.perf_counter() - started
    rows = table_rows(results)
    n_scored = len(scored_positions(args.ctx))
    texts = ", ".join(Path(p).name for p in (args.text or [DEFAULT_TEXT]))
    llama_flags = " ".join(["-c", str(args.ctx), "-b", str(args.ctx), *shlex.split(args.llama_args)])
    reference_ppl = ", ".join(f"{r['model']} {r['reference_ppl']:.3f}" for r in results)
    reference_s = ", ".join(f"{r['reference_s']:.0f} s" for r in results)
    notes = (f"{args.chunks} chunks of {args.ctx} tokens of {texts}, each from an empty context, the last "
             f"{n_scored} positions of each scored: {args.chunks * n_scored} positions a model. Reference: "
             "float64 NumPy forward pass and head. `mean KL`, `p99 KL`, `same top-1 %` and `PPL`: "
             "llama-perplexity's formula against the reference written in its --kl-divergence-base format "
             "(16-bit log-probabilities, tokens below e^-16 left out), computed by llama-perplexity for "
             "llama.cpp and by this script for ours; `exact`: ours in float64 over the whole vocabulary. "
             f"Reference perplexity: {reference_ppl}. Ours: ModelRunner, paged, f16 KV, prefill steps of "
             f"{args.batch}; llama.cpp: llama-perplexity {llama_flags}, its defaults otherwise; {args.threads} "
             f"threads each. Whole run {elapsed:.0f} s (reference forward passes: {reference_s}; 0 when cached).")
    print(markdown_table(rows))
    print(notes)
    return write_report("kl_divergence", args, {"results": results, "elapsed_s": elapsed}, rows, out_dir=out,
                        title="KL divergence from the float64 reference", notes=notes,
                        plot=lambda path: plot(results, path))


if __name__ == "__main__":
    sys.exit(main())
