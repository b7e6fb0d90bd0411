"""CUDA paged decode attention (native/cuda/): achieved memory bandwidth at
1k-32k context vs the device's peak. Needs a GPU and nvcc; without them it
says so and writes nothing. The comparison with GGML's CUDA flash attention on
contiguous K/V needs GGML built with CUDA (issue 13, stage 1) and is not here
yet.

    python -m bench.kernels.cuda_attention [--arch sm_90] [--seqs 16] [--peak-gbs 3350]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.report import REPO_ROOT, RESULTS_DIR, nvidia_gpus, write_results
from pyllama_paged.testing.cuda_harness import CudaHarness, build


def device_name() -> str:
    """The first GPU's name, from nvidia-smi."""
    gpus = nvidia_gpus()
    return gpus[0]["name"] if gpus else "unknown GPU"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", default="32,8", help="query heads, KV heads")
    ap.add_argument("--peak-gbs", type=float, default=None, help="the device's peak bandwidth (H100 SXM: 3350)")
    ap.add_argument("--iters", type=int, default=50)
    add_options(ap, block_size=32, out=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    path = build(Path(tempfile.mkdtemp()), REPO_ROOT / "native" / "cuda", args.arch)
    if path is None:
        print("nvcc is not installed: nothing measured")
        return 1
    h = CudaHarness(path)
    if h.devices == 0:
        print("no CUDA device: nothing measured")
        return 1
    name = device_name()
    n_head, n_kv = (int(x) for x in args.heads.split(","))
    rng = np.random.default_rng(0)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        bs = args.block_size
        blocks_per_seq = -(-ctx // bs)
        num_blocks = blocks_per_seq * args.seqs
        tables = rng.permutation(num_blocks).reshape(args.seqs, blocks_per_seq).astype(np.int32)
        k = rng.standard_normal((num_blocks * bs, n_kv, args.head_dim)).astype(np.float16)
        v = rng.standard_normal((num_blocks * bs, n_kv, args.head_dim)).astype(np.float16)
        q = rng.standard_normal((args.seqs, n_head, args.head_dim)).astype(np.float32)
        _, ms = h.decode(q, k, v, tables, [ctx] * args.seqs, bs, 0, 1 / np.sqrt(args.head_dim), 0, args.iters)
        bytes_read = 2 * args.seqs * ctx * n_kv * args.head_dim * 2
        gbs = bytes_read / (ms * 1e-3) / 1e9
        rows.append({"context": ctx, "sequences": args.seqs, "ms": ms, "GB/s": gbs,
                     "share of peak": gbs / args.peak_gbs if args.peak_gbs else None})
        print(rows[-1], flush=True)
    write_results("cuda_attention", {"params": vars(args), "device": name, "rows": rows}, rows,
                  out_dir=Path(args.out), title=f"CUDA paged decode attention on {name}",
                  notes=f"{args.seqs} sequences, {n_head} query / {n_kv} KV heads of {args.head_dim}, f16 pages of "
                        f"{args.block_size} tokens in shuffled order; bytes = K+V read once per KV head.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
