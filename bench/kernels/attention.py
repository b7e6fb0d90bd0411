"""The paged attention kernel alone against GGML's own contiguous flash
attention (ggml_flash_attn_ext) on the same K/V data: one decode query
(1 token at the last position) per call, context lengths 512..16k, KV f16 and
q8_0, page (block) sizes 16/32/64/128.

Setup (per head shape and KV type): one AttentionHarness pool of
(1 + 2 x number of block sizes) x max_ctx token slots. Slots [0, max_ctx)
hold the sequence contiguously (what GGML's flash attention reads); for each
block size, the same logical rows are also written into max_ctx / block_size
pages drawn at random, in random order, from that block size's own region of
2 x max_ctx slots (the paged kernel reads those through its block table), so
pages are scattered and almost never adjacent to their logical neighbour. A context
of n tokens uses the first n rows / first n/block_size table entries.

Timing: wall time of one harness call from Python (cffi call, graph build,
thread wake-up and the kernel; the same harness machinery on both sides), a
burst per variant, the variants in a shuffled order per round, --rounds
rounds; the median over all calls. "GB/s" = K+V bytes of the context read
once (n * n_head_kv * row bytes of head_dim, for K and V) / time. By default
the caches are warm (the same call repeats; a 16k context of the default
model's shape is 16 MB in f16, within this CPU's L3): --cold streams a 64 MB
buffer between calls (not timed) so every call reads K/V from DRAM. The
fixed per-call cost (a 1-token context) is reported separately.

Every configuration also checks paged == contiguous output (max abs diff).

    python -m bench.kernels.attention                       # default: gemma3-270m shape
    python -m bench.kernels.attention --shapes gemma3-270m,llama --cold
"""

from __future__ import annotations

import random
import statistics
import time

import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, markdown_table, save_figure, script_parser, write_results

SHAPES = {  # name: (n_head, n_head_kv, head_dim)
    "gemma3-270m": (4, 1, 256),
    "llama": (32, 8, 128),
}
ROW_BYTES = {"f16": lambda d: 2 * d, "q8_0": lambda d: d // 32 * 34, "q4_0": lambda d: d // 32 * 18}


class Flusher:
    def __init__(self, mb: int):
        self.buf = np.ones(mb * 2**20 // 8, np.float64) if mb else None

    def __call__(self):
        if self.buf is not None:
            self.buf += 1.0


def time_calls(fn, n: int, flush) -> list[float]:
    out = []
    for _ in range(n):
        flush()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_shape(shape_name: str, kv: str, args, rng: np.random.Generator) -> list[dict]:
    from pyllama_paged.testing.attention_harness import AttentionHarness

    n_head, n_head_kv, head_dim = SHAPES[shape_name]
    max_ctx = max(args.contexts)
    width = n_head_kv * head_dim
    n_bs = len(args.block_sizes)
    h = AttentionHarness(kv, (1 + 2 * n_bs) * max_ctx, n_head, n_head_kv, head_dim, n_threads=args.threads)
    k = rng.standard_normal((max_ctx, width), dtype=np.float32)
    v = rng.standard_normal((max_ctx, width), dtype=np.float32)
    chunk = 4096
    for s in range(0, max_ctx, chunk):
        h.write(np.arange(s, min(s + chunk, max_ctx)), k[s:s + chunk], v[s:s + chunk])
    flush = Flusher(args.flush_mb if args.cold else 0)
    scale = head_dim ** -0.5
    q = rng.standard_normal((1, n_head, head_dim), dtype=np.float32)
    row = ROW_BYTES[kv](head_dim)

    # per block size: a shuffled page table inside [max_ctx, 3*max_ctx) and the rows written there
    tables = {}
    for i, bs in enumerate(args.block_sizes):
        if max_ctx % bs:
            raise SystemExit(f"max context {max_ctx} is not a multiple of block size {bs}")
        region_blocks = 2 * max_ctx // bs          # this block size's own region of the pool
        table = rng.choice(region_blocks, size=max_ctx // bs, replace=False).astype(np.int32)
        table += (1 + 2 * i) * max_ctx // bs
        slots = (table[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)
        for s in range(0, max_ctx, chunk):
            h.write(slots[s:s + chunk], k[s:s + chunk], v[s:s + chunk])
        tables[bs] = table

    def contiguous(n):
        return lambda: h.contiguous(q, 0, n, [n - 1], 0, scale)

    def paged(n, bs):
        t = tables[bs][None, : -(-n // bs)]
        return lambda: h.paged(q, [n - 1], [0], t, bs, 0, scale)

    # fixed per-call cost: a 1-token context
    overhead = {"contiguous": statistics.median(time_calls(contiguous(1), 200, lambda: None))}
    for bs in args.block_sizes:
        overhead[f"paged-{bs}"] = statistics.median(time_calls(paged(1, bs), 200, lambda: None))

    print(f"{shape_name} {kv}: fixed per-call cost (1-token context) " +
          ", ".join(f"{k_} {v_ * 1e6:.0f} us" for k_, v_ in overhead.items()), flush=True)
    rows = []
    for n in args.contexts:
        variants = {"contiguous": contiguous(n), **{f"paged-{bs}": paged(n, bs) for bs in args.block_sizes}}
        ref = variants["contiguous"]()
        max_diff = max(float(np.max(np.abs(
            h.paged(q, [n - 1], [0], tables[bs][None, : -(-n // bs)], bs, 0, scale) - ref)))
            for bs in args.block_sizes)
        if max_diff > args.tolerance:
            print(f"WARNING: paged output differs from contiguous by {max_diff:.3g} "
                  f"({shape_name} {kv} ctx {n})", flush=True)
        for fn in variants.values():      # warm-up
            fn()
        # calls per burst: about min_time / rounds / variants seconds, within [3, 200]
        t1 = min(time_calls(variants["contiguous"], 3, flush))
        burst = int(min(200, max(3, args.min_time / args.rounds / max(t1, 1e-6))))
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            order = list(variants)
            random.shuffle(order)
            for name in order:
                times[name] += time_calls(variants[name], burst, flush)
        kv_bytes = 2 * n * n_head_kv * row
        med = {name: statistics.median(ts) for name, ts in times.items()}
        c = med["contiguous"]
        entry = {"shape": shape_name, "n_head": n_head, "n_head_kv": n_head_kv,
                 "head_dim": head_dim, "kv": kv, "ctx": n, "kv_bytes": kv_bytes,
                 "calls_per_variant": len(times["contiguous"]),
                 "contiguous_us": c * 1e6, "contiguous_gbs": kv_bytes / c / 1e9,
                 "max_abs_diff_paged_vs_contiguous": max_diff, "paged": {}}
        for bs in args.block_sizes:
            p = med[f"paged-{bs}"]
            entry["paged"][bs] = {"us": p * 1e6, "gbs": kv_bytes / p / 1e9,
                                  "overhead_pct": (p / c - 1) * 100,
                                  "min_us": min(times[f"paged-{bs}"]) * 1e6}
        entry["contiguous_min_us"] = min(times["contiguous"]) * 1e6
        entry["per_call_fixed_us"] = {k_: v_ * 1e6 for k_, v_ in overhead.items()}
        rows.append(entry)
        print(f"{shape_name} {kv:5s} ctx {n:6d}: contiguous {c * 1e6:8.1f} us "
              f"({kv_bytes / c / 1e9:5.1f} GB/s) | " +
              " ".join(f"p{bs} {entry['paged'][bs]['us']:8.1f} ({entry['paged'][bs]['overhead_pct']:+5.1f}%)"
                       for bs in args.block_sizes) + f" | diff {max_diff:.1e}", flush=True)
    h.close()
    return rows


def table_rows(results: list[dict], block_sizes: list[int]) -> list[dict]:
    out = []
    for r in results:
        row = {"shape": f"{r['shape']} ({r['n_head']}/{r['n_head_kv']}/{r['head_dim']})", "kv": r["kv"],
               "ctx": r["ctx"], "contiguous µs": r["contiguous_us"], "contiguous GB/s": r["contiguous_gbs"]}
        for bs in block_sizes:
            p = r["paged"][bs]
            row[f"paged-{bs} µs (vs contiguous)"] = f"{p['us']:.1f} ({p['overhead_pct']:+.1f}%)"
        best = min(block_sizes, key=lambda b: r["paged"][b]["us"])
        row["best paged GB/s"] = r["paged"][best]["gbs"]
        out.append(row)
    return out


def plot(results: list[dict], block_sizes: list[int], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["shape"], r["kv"]) for r in results}, key=lambda g: (list(SHAPES).index(g[0]), g[1]))
    fig, axes = plt.subplots(2, len(groups), figsize=(4.6 * len(groups), 7.5), squeeze=False,
                             sharex=True)
    for j, (shape, kv) in enumerate(groups):
        rs = [r for r in results if r["shape"] == shape and r["kv"] == kv]
        ctx = [r["ctx"] for r in rs]
        ax, ax2 = axes[0][j], axes[1][j]
        ax.plot(ctx, [r["contiguous_us"] for r in rs], "k-o", lw=2, label="GGML flash attn (contiguous)")
        for bs in block_sizes:
            ax.plot(ctx, [r["paged"][bs]["us"] for r in rs], "-s", ms=3, label=f"paged, block {bs}")
            ax2.plot(ctx, [r["paged"][bs]["overhead_pct"] for r in rs], "-s", ms=3, label=f"block {bs}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{shape} {SHAPES[shape]}, KV {kv}")
        ax.set_ylabel("µs per call (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax2.axhline(0, color="k", lw=1)
        ax2.axhline(10, color="r", lw=0.8, ls="--")
        ax2.axhline(-10, color="r", lw=0.8, ls="--")
        ax2.set_xlabel("context (tokens)")
        ax2.set_ylabel("paged vs contiguous (%)")
        ax2.grid(True, alpha=0.3)
        if j == 0:
            ax.legend(fontsize=7)
            ax2.legend(fontsize=7)
    fig.suptitle("One decode query: paged kernel vs GGML contiguous flash attention")
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = script_parser(__doc__)
    add_options(ap, threads=2, seed=0)
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--block-sizes", default="16,32,64,128")
    ap.add_argument("--kv-types", default="f16,q8_0")
    ap.add_argument("--shapes", default="gemma3-270m",
                    help=f"comma list of {', '.join(SHAPES)} (gemma3-270m = the default model)")
    ap.add_argument("--min-time", type=float, default=0.6, help="seconds of calls per variant and context")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="evict caches between calls")
    ap.add_argument("--flush-mb", type=int, default=64)
    ap.add_argument("--tolerance", type=float, default=1e-2, help="warn above this paged-vs-contiguous diff")
    ap.add_argument("--name", default="attention", help="results/<name>.{json,md,png}")
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.block_sizes = [int(x) for x in args.block_sizes.split(",")]
    kv_types = [x for x in args.kv_types.split(",") if x]
    shapes = [x for x in args.shapes.split(",") if x]

    from pyllama_paged._native import ffi, lib
    build = ffi.string(lib.pp_ggml_build_info()).decode()
    random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    results = []
    for shape in shapes:
        for kv in kv_types:
            results += bench_shape(shape, kv, args, rng)
    rows = table_rows(results, args.block_sizes)
    print(markdown_table(rows))
    worst = max(abs(r["paged"][bs]["overhead_pct"]) for r in results for bs in args.block_sizes
                if r["ctx"] >= 2048)
    fixed = results[0]["per_call_fixed_us"]
    notes = (f"One decode query at the last position, {args.threads} threads, "
             f"{'cold caches (64 MB streamed between calls)' if args.cold else 'warm caches'}; "
             f"median µs per call (Python → cffi → graph → kernel; {args.rounds} rounds of bursts, "
             f"variants shuffled each round); paged pages in random order. GB/s = K+V bytes of the "
             f"context / time. Fixed per-call cost (1-token context, first shape/kv): "
             + ", ".join(f"{k} {v:.0f} µs" for k, v in fixed.items())
             + f". Largest |paged vs contiguous| at ctx ≥ 2048: {worst:.1f}%. GGML: {build}. "
             f"Plot: `{args.name}.png`.")
    data = {"threads": args.threads, "cold": args.cold, "contexts": args.contexts,
            "block_sizes": args.block_sizes, "kv_types": kv_types, "shapes": {s: SHAPES[s] for s in shapes},
            "ggml_build_info": build, "seconds": round(time.time() - t0, 1), "results": results}
    paths = write_results(args.name, data, rows, title="Paged attention kernel vs GGML contiguous flash "
                          "attention (one decode query)", notes=notes)
    plot(results, args.block_sizes, RESULTS_DIR / f"{args.name}.png")
    print(f"wrote {paths['json']}, {paths['md']}, {RESULTS_DIR / (args.name + '.png')} "
          f"in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
