"""Block-pool operations per second, straight through the C API and through
the Python API (pyllama_paged.BlockPool over cffi), on the same workload.

Workload per request: create a sequence from a --prompt-len token prompt
(default 100), append --gen-len tokens one at a time (default 50), fork it
once, free the child and the parent. Token ids never repeat, so there are no
prefix-cache hits; freed full blocks become cached blocks and, once the free
list is used up, new blocks come from evicting the least recently used cached
block (a warm server's steady state).

Measurements (identical in C and Python):
- phased: rounds of --concurrency R requests; each phase timed on its own:
  create R; --gen-len passes appending one token to each of the R (the way a
  decode step does); fork each; free the R children and R parents.
  ops/s = operations in the phase / time in the phase (append counts tokens).
- cycle: one request at a time, its whole life back to back; requests/s.
Each runs for at least --min-time seconds, --repeats times; the best repeat is
reported (the machine is shared; the best run is the least disturbed one).

The C side: bench/kernels/pool_ops.c compiled with `cc -O2` against the INSTALLED
package's header (pyllama_paged/include/pyllama_paged.h) and library
(libpyllama_paged.so; -L and -Wl,-rpath to the package directory), in a
temporary directory. The library itself is built by the package build
(CMake Release).

Outputs: bench/results/pool_ops.{json,md} (or --out DIR).
Run: python -m bench.kernels.pool_ops [options]
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, markdown_table, script_parser, write_results

from pyllama_paged.engine.kv.block_pool import BlockPool
from pyllama_paged import _native

OPS = ("create", "append", "fork", "free", "cycle")
OP_LABELS = {
    "create": "create (100-token prompt)",
    "append": "append (1 token)",
    "fork": "fork",
    "free": "free",
    "cycle": "request cycle",
}


# ---- C ----------------------------------------------------------------------

def compile_c(cc: str, workdir: Path) -> tuple[Path, list[str]]:
    pkg_dir = _native.LIBRARY_PATH.parent
    include = _native.HEADER_PATH.parent
    exe = workdir / "pool_ops"
    cmd = [*shlex.split(cc), "-O2", "-std=c11", "-Wall", "-Wextra", f"-I{include}",
           str(Path(__file__).resolve().parent / "pool_ops.c"), f"-L{pkg_dir}", "-lpyllama_paged",
           f"-Wl,-rpath,{pkg_dir}", "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"compiling pool_ops.c failed:\n{shlex.join(cmd)}\n{proc.stderr}")
    if proc.stderr.strip():
        print(proc.stderr, file=sys.stderr)
    return exe, cmd


def run_c(exe: Path, block_size: int, num_blocks: int, args) -> dict:
    cmd = [str(exe), str(block_size), str(num_blocks), str(args.concurrency),
           str(args.prompt_len), str(args.gen_len), str(args.min_time), str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pool_ops failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout)


def cc_version(cc: str) -> str | None:
    try:
        out = subprocess.run([*shlex.split(cc), "--version"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else None


# ---- Python -----------------------------------------------------------------

class Tokens:
    """Never-repeating token ids, the same scheme as pool_ops.c."""

    def __init__(self):
        self.base = 1

    def prompt(self, n: int) -> np.ndarray:
        out = (np.arange(self.base, self.base + n, dtype=np.int64) & 0x7FFFFFFF).astype(np.int32)
        self.base += n + 1000
        return out

    def singles(self, n: int) -> list[list[int]]:
        out = [[(self.base + i) & 0x7FFFFFFF] for i in range(n)]
        self.base += n + 1000
        return out


def run_phased_py(pool: BlockPool, toks: Tokens, R: int, prompt_len: int, gen_len: int,
                  min_time: float) -> dict[str, tuple[int, float]]:
    t = {op: 0.0 for op in ("create", "append", "fork", "free")}
    n = {op: 0 for op in t}
    create, append, fork, free = pool.create_sequence, pool.append, pool.fork, pool.free
    clock = time.perf_counter
    elapsed = 0.0
    while elapsed < min_time:
        prompts = [toks.prompt(prompt_len) for _ in range(R)]
        singles = toks.singles(R * gen_len)
        t0 = clock()
        parents = [create(p)[0] for p in prompts]
        t1 = clock()
        it = iter(singles)
        for _ in range(gen_len):
            for sid in parents:
                append(sid, next(it))
        t2 = clock()
        children = [fork(sid) for sid in parents]
        t3 = clock()
        for c, p in zip(children, parents):
            free(c)
            free(p)
        t4 = clock()
        for op, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            t[op] += dt
        n["create"] += R
        n["append"] += R * gen_len
        n["fork"] += R
        n["free"] += 2 * R
        elapsed += t4 - t0
    return {op: (n[op], t[op]) for op in t}


def run_cycle_py(pool: BlockPool, toks: Tokens, R: int, prompt_len: int, gen_len: int,
                 min_time: float) -> tuple[float, int]:
    create, append, fork, free = pool.create_sequence, pool.append, pool.fork, pool.free
    clock = time.perf_counter
    busy, n = 0.0, 0
    while busy < min_time:
        prompts = [toks.prompt(prompt_len) for _ in range(R)]
        singles = toks.singles(R * gen_len)
        it = iter(singles)
        t0 = clock()
        for p in prompts:
            sid = create(p)[0]
            for _ in range(gen_len):
                append(sid, next(it))
            child = fork(sid)
            free(child)
            free(sid)
        busy += clock() - t0
        n += R
    return n / busy, n


def run_py(block_size: int, num_blocks: int, args) -> dict:
    toks = Tokens()
    best = {op: 0.0 for op in OPS}
    cycle_requests = 0
    with BlockPool(num_blocks, block_size) as pool:
        run_phased_py(pool, toks, args.concurrency, args.prompt_len, args.gen_len, 0.0)  # warm-up
        for _ in range(args.repeats):
            phased = run_phased_py(pool, toks, args.concurrency, args.prompt_len, args.gen_len,
                                   args.min_time)
            for op, (n, t) in phased.items():
                best[op] = max(best[op], n / t if t > 0 else 0.0)
            rate, n = run_cycle_py(pool, toks, args.concurrency, args.prompt_len, args.gen_len,
                                   args.min_time)
            best["cycle"] = max(best["cycle"], rate)
            cycle_requests += n
        s = pool.stats()
        final = {k: getattr(s, k) for k in ("num_free", "num_used", "num_cached", "num_seqs",
                                            "num_evictions", "num_hits")}
    return {"impl": "Python", "block_size": block_size, "num_blocks": num_blocks,
            "ops_per_s": best, "cycle_requests": cycle_requests, "final_stats": final}


# ---- main ----------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--block-sizes", default="16,32")
    ap.add_argument("--concurrency", type=int, default=64, help="requests per phased round (R)")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--gen-len", type=int, default=50)
    ap.add_argument("--num-blocks", type=int, default=0,
                    help="pool size in blocks (0: 4x what R requests hold, at least 1024)")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds per measurement")
    ap.add_argument("--cc", default="cc", help="C compiler command")
    ap.add_argument("--skip-c", action="store_true", help="only the Python API")
    add_options(ap, repeats=5, out=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    block_sizes = [int(b) for b in args.block_sizes.split(",") if b.strip()]
    OP_LABELS["create"] = f"create ({args.prompt_len}-token prompt)"

    t_start = time.perf_counter()
    results = []
    compile_cmd = None
    with tempfile.TemporaryDirectory(prefix="pool_ops_") as tmp:
        exe = None
        if not args.skip_c:
            exe, compile_cmd = compile_c(args.cc, Path(tmp))
        for bs in block_sizes:
            per_req = -(-(args.prompt_len + args.gen_len) // bs)
            num_blocks = args.num_blocks or max(1024, 4 * args.concurrency * per_req)
            if exe is not None:
                results.append(run_c(exe, bs, num_blocks, args))
            results.append(run_py(bs, num_blocks, args))

    rows = []
    for bs in block_sizes:
        c = next((r for r in results if r["impl"] == "C" and r["block_size"] == bs), None)
        p = next(r for r in results if r["impl"] == "Python" and r["block_size"] == bs)
        for op in OPS:
            row = {"op": OP_LABELS[op], "block": bs}
            if c is not None:
                row["C ops/s"] = round(c["ops_per_s"][op])
                row["C ns/op"] = 1e9 / c["ops_per_s"][op]
            row["Python ops/s"] = round(p["ops_per_s"][op])
            row["Python ns/op"] = 1e9 / p["ops_per_s"][op]
            if c is not None:
                row["Python/C time"] = c["ops_per_s"][op] / p["ops_per_s"][op]
            rows.append(row)

    params = {"block_sizes": block_sizes, "concurrency": args.concurrency,
              "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "num_blocks": args.num_blocks or "auto", "min_time_s": args.min_time,
              "repeats": args.repeats}
    data = {"params": params, "results": results, "compile_command": compile_cmd,
            "wall_s": time.perf_counter() - t_start}
    title = (f"Block pool operations/s: C API vs Python API ({args.prompt_len}-token prompt, "
             f"{args.gen_len} appends of 1 token, fork, 2 frees)")
    notes = (
        f"Parameters: {params}. Phased rows: R={args.concurrency} concurrent requests per round, "
        "each phase timed on its own (append interleaves the R sequences one token at a time, "
        "like decode steps; free counts the child and the parent frees). 'request cycle' = "
        "requests/s for one request's whole life back to back (create, "
        f"{args.gen_len} appends, fork, 2 frees = {args.gen_len + 4} calls). Best of "
        f"{args.repeats} repeats of >= {args.min_time} s each. Token ids never repeat (no "
        "prefix-cache hits; allocations evict LRU cached blocks once the free list is empty). "
        "Python/C time = how many times longer an operation takes through the Python API. "
        "C side: bench/kernels/pool_ops.c, cc -O2, linked to the installed libpyllama_paged.so."
    )
    extra = {"cc": cc_version(args.cc) if not args.skip_c else None,
             "library_build": "CMake Release (see CMakeLists.txt)"}
    paths = write_results("pool_ops", data, rows, out_dir=args.out, title=title, notes=notes,
                          extra_machine=extra)
    print(title)
    print(markdown_table(rows))
    print(f"wrote {paths['json']}, {paths['md']} in {data['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
