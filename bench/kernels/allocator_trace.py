"""Allocator experiment: naive max-length slabs vs exact-size contiguous
first-fit vs our paged C BlockPool, side by side on one seeded request trace
and one fixed KV budget (in tokens).

Model of the serving loop (identical for every allocator)
---------------------------------------------------------
Time advances in *steps*; one step is one decode iteration of the running
batch (continuous batching): every running request generates exactly one
token per step. A request is admitted with its whole prompt (prefill) and then
grows one token per step until it has generated its output length; it is
freed at the end of the step that produced its last token. So a request's
finish time follows from its length and from when it was admitted.

Trace (seeded): total lengths L ~ log-normal with mean --mean-len (sigma
--sigma of the underlying normal), rounded and clipped to [2, --max-seq-len]
(a request cannot exceed the model's context); a prompt fraction
f ~ U(0.2, 0.8) splits L into prompt = round(f*L) (>= 1) and output = L - prompt
(>= 1). Arrivals are Poisson with --arrival-rate requests per step. Token ids
are random (no two requests share a prefix), so the pool's prefix cache plays
no part in admission; this experiment is about allocation only.

Allocators, all over the same budget of --budget-tokens token slots:

- naive: every request reserves one contiguous slab of --max-seq-len slots
  (the model context, default 2048) on admission, first-fit in a linear
  address space of the budget. This is the baseline of the seeds (and the
  engine's paged=False mode: a KV slab of n_ctx per sequence).
- contiguous (exact-size): every request reserves exactly its final length
  (prompt + output, known in advance: an oracle a real server does not have,
  i.e. the best case for contiguous allocation), first-fit in the same linear
  address space. Internal waste is only the not-yet-generated tail; the loss
  is external fragmentation: free memory split into holes too small for the
  next request.
- paged-B: our native BlockPool with num_blocks = budget // B blocks of B
  tokens. A request takes ceil(prompt/B) blocks on admission and one more
  block whenever its last block fills. Any free block serves any request, so
  the largest usable free region is all free memory.

Admission policy (all allocators): strict FCFS with head-of-line blocking
(the request at the head of the queue is admitted if its allocation fits;
if not, nobody behind it is admitted this step). A request that waited more
than --max-wait steps without being admitted is rejected (a client timeout);
--max-wait 0 disables rejections (then only queueing time grows). The paged
allocator admits a request only if its prompt leaves a watermark of
--watermark (fraction, default 1%, as vLLM) of the blocks free; if a running
request cannot get its next block, the most recently admitted running request
is preempted (its blocks are freed; it goes back to the head of the queue and
is re-admitted later with its prompt plus the tokens it already generated,
i.e. recompute, as vLLM does). Preempted requests are never rejected.

Metrics (sampled once per step, after the step's tokens are written and
before finished requests are freed):

- utilization = tokens stored / token slots reserved (for paged: the pool's
  tokens_stored / slots_held); mean over the steps where anything is held,
  and peak;
- occupancy = tokens stored / budget (how much of the KV budget holds real
  tokens; the seeds' "cache utilization");
- free memory and the largest free hole (contiguous allocators); for paged
  the largest usable region equals total free (free + evictable cached blocks);
- frag. stalls: steps in which the queue head did not fit although the total
  free memory was enough for it (external fragmentation at work);
- util when full: mean utilization over the steps where >= 90% of the budget
  is reserved, i.e. when memory is the bottleneck (peak utilization alone is
  trivially 100% for any allocator at some quiet moment);
- completion: the step at which the last request finished or was rejected
  (an allocator that rejects long requests can finish "earlier"; compare it
  together with admitted/rejected and generated tokens); queue wait and
  end-to-end latency in steps. gen tok/step = generated tokens of admitted
  requests / completion steps (each running request makes one token a step,
  so this is also the mean batch size).

For naive every hole is a whole number of slabs, so its ext. frag number
(1 - largest hole / total free) never stalls admission; frag. stalls counts
the stalls that fragmentation actually caused.

Defaults and why: 2000 requests, mean length 200 (sigma 1.0: median ~120, p99
~1150, a few clipped at 2048), budget 32768 tokens (16 naive slabs of 2048),
block sizes 16 (vLLM's default) and 32 (this project's default; whole Q8_0
/Q4_0 groups), 0.8 requests/step, max wait 500 steps. At 0.8 req/step the
offered load is ~77 generated tokens/step: the paged pool carries it with
short waits and a few preemptions (it is loaded, peak occupancy ~98%, not
idle), the exact-size contiguous allocator is saturated by fragmentation
(long waits, some long requests rejected) and naive is ~4x over capacity.
At 0.6 req/step nothing but naive rejects; from ~0.9 up paged queues too.
Use --arrival-rate to sweep the load.

Outputs: bench/results/allocator_trace.{json,md,png} (or --out DIR).
Run: python -m bench.kernels.allocator_trace [options]
"""

from __future__ import annotations

import bisect
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, markdown_table, save_figure, script_parser, write_results

from pyllama_paged.engine.kv.block_pool import BlockPool
from pyllama_paged.errors import OutOfBlocksError


# ---- trace ---------------------------------------------------------------------

@dataclass
class Request:
    idx: int
    arrival: int          # step at which it joins the queue
    prompt_len: int
    output_len: int
    tokens: np.ndarray    # prompt + output token ids (int32), for the paged pool

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def make_trace(num_requests: int, mean_len: float, sigma: float, max_seq_len: int,
               arrival_rate: float, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    mu = np.log(mean_len) - sigma ** 2 / 2          # so that E[L] = mean_len before clipping
    lengths = np.clip(np.rint(rng.lognormal(mu, sigma, num_requests)), 2, max_seq_len).astype(int)
    frac = rng.uniform(0.2, 0.8, num_requests)
    prompts = np.clip(np.rint(frac * lengths), 1, lengths - 1).astype(int)
    gaps = rng.exponential(1.0 / arrival_rate, num_requests)
    arrivals = np.floor(np.cumsum(gaps)).astype(int)
    reqs = []
    for i in range(num_requests):
        toks = rng.integers(1, 32000, int(lengths[i]), dtype=np.int32)
        reqs.append(Request(i, int(arrivals[i]), int(prompts[i]),
                            int(lengths[i] - prompts[i]), toks))
    return reqs


# ---- allocators -----------------------------------------------------------------

class LinearFirstFit:
    """First-fit allocation of contiguous ranges in [0, capacity); free ranges
    are kept sorted by start and coalesced on release."""

    def __init__(self, capacity: int):
        self.starts = [0]
        self.sizes = [capacity]
        self.free_total = capacity

    def alloc(self, n: int) -> int | None:
        for i, size in enumerate(self.sizes):
            if size >= n:
                start = self.starts[i]
                if size == n:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += n
                    self.sizes[i] -= n
                self.free_total -= n
                return start
        return None

    def release(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.sizes.insert(i, n)
        self.free_total += n
        # merge with the next hole, then with the previous one
        if i + 1 < len(self.starts) and self.starts[i] + self.sizes[i] == self.starts[i + 1]:
            self.sizes[i] += self.sizes[i + 1]
            del self.starts[i + 1], self.sizes[i + 1]
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == self.starts[i]:
            self.sizes[i - 1] += self.sizes[i]
            del self.starts[i], self.sizes[i]

    def largest(self) -> int:
        return max(self.sizes, default=0)


class ContiguousAllocator:
    """naive (fixed slab of max_seq_len) or exact (final length) reservations."""

    def __init__(self, name: str, budget: int, slab: int | None):
        self.name = name
        self.space = LinearFirstFit(budget)
        self.slab = slab              # None: exact final length
        self.where: dict[int, tuple[int, int]] = {}
        self.reserved = 0

    def need(self, r: Request, cur_len: int) -> int:
        return self.slab if self.slab is not None else r.total_len

    def admit(self, r: Request, cur_len: int) -> bool:
        n = self.need(r, cur_len)
        start = self.space.alloc(n)
        if start is None:
            return False
        self.where[r.idx] = (start, n)
        self.reserved += n
        return True

    def grow(self, r: Request, cur_len: int) -> bool:
        return True                   # reserved up front, never grows

    def release(self, r: Request) -> None:
        start, n = self.where.pop(r.idx)
        self.space.release(start, n)
        self.reserved -= n

    def snapshot(self, tokens_stored: int) -> tuple[int, int, int, int]:
        return tokens_stored, self.reserved, self.space.free_total, self.space.largest()

    def close(self) -> None:
        pass


class PagedAllocator:
    """The native BlockPool; admission keeps a watermark of free blocks."""

    def __init__(self, budget: int, block_size: int, watermark: float):
        self.name = f"paged-{block_size}"
        self.block_size = block_size
        self.num_blocks = budget // block_size
        self.pool = BlockPool(self.num_blocks, block_size)
        self.watermark = max(1, int(watermark * self.num_blocks)) if watermark > 0 else 0
        self.seq: dict[int, int] = {}

    def need(self, r: Request, cur_len: int) -> int:
        return -(-cur_len // self.block_size) * self.block_size

    def admit(self, r: Request, cur_len: int) -> bool:
        blocks = -(-cur_len // self.block_size)
        if self.pool.num_allocatable - blocks < self.watermark:
            return False
        try:
            seq_id, _ = self.pool.create_sequence(r.tokens[:cur_len])
        except OutOfBlocksError:
            return False
        self.seq[r.idx] = seq_id
        return True

    def grow(self, r: Request, cur_len: int) -> bool:
        # cur_len: length after the append; its token is tokens[cur_len - 1]
        try:
            self.pool.append(self.seq[r.idx], [int(r.tokens[cur_len - 1])])
        except OutOfBlocksError:
            return False
        return True

    def release(self, r: Request) -> None:
        self.pool.free(self.seq.pop(r.idx))

    def snapshot(self, tokens_stored: int) -> tuple[int, int, int, int]:
        s = self.pool.stats()
        if s.tokens_stored != tokens_stored or s.tokens_logical != tokens_stored:
            raise AssertionError(f"{self.name}: pool counts {s.tokens_stored} stored / "
                                 f"{s.tokens_logical} logical tokens, the trace {tokens_stored}")
        free = (s.num_free + s.num_cached) * self.block_size
        return s.tokens_stored, s.slots_held, free, free

    def close(self) -> None:
        self.pool.close()


class WindowPagedAllocator(PagedAllocator):
    """The native BlockPool in layer groups with real per-group byte costs: the
    same bytes as budget tokens of every layer, cut into blocks of one group
    (num_blocks = budget * groups / block_size); window groups give pages back
    as tokens are computed. Figures are reported in tokens of every layer (a
    group's slot is 1/groups of one)."""

    def __init__(self, budget: int, block_size: int, watermark: float, group_window: list[int]):
        self.name = f"paged-{block_size}-windows"
        self.block_size = block_size
        self.groups = len(group_window)
        self.num_blocks = budget * self.groups // block_size
        self.pool = BlockPool(self.num_blocks, block_size, group_window)
        self.watermark = max(1, int(watermark * self.num_blocks)) if watermark > 0 else 0
        self.seq: dict[int, int] = {}

    def admit(self, r: Request, cur_len: int) -> bool:
        if self.pool.num_allocatable - -(-cur_len // self.block_size) * self.groups < self.watermark:
            return False
        try:
            seq_id, _ = self.pool.create_sequence(r.tokens[:cur_len])
        except OutOfBlocksError:
            return False
        self.pool.mark_computed(seq_id, cur_len)   # the prefill step computes the prompt
        self.seq[r.idx] = seq_id
        return True

    def grow(self, r: Request, cur_len: int) -> bool:
        if not super().grow(r, cur_len):
            return False
        self.pool.mark_computed(self.seq[r.idx], cur_len)
        return True

    def snapshot(self, tokens_stored: int) -> tuple[int, int, int, int]:
        s = self.pool.stats()
        free = (s.num_free + s.num_cached) * self.block_size // self.groups
        return s.tokens_stored // self.groups, s.slots_held // self.groups, free, free


# ---- simulation -----------------------------------------------------------------

@dataclass
class State:
    req: Request
    generated: int = 0
    admit_step: int | None = None     # first admission
    finish_step: int | None = None
    preemptions: int = 0

    @property
    def cur_len(self) -> int:
        return self.req.prompt_len + self.generated


@dataclass
class Series:
    util: list = field(default_factory=list)
    occupancy: list = field(default_factory=list)
    reserved: list = field(default_factory=list)
    free: list = field(default_factory=list)
    largest: list = field(default_factory=list)
    running: list = field(default_factory=list)
    queued: list = field(default_factory=list)


def simulate(alloc, trace: list[Request], budget: int, max_wait: int) -> tuple[dict, Series]:
    states = [State(r) for r in trace]
    waiting: deque[State] = deque()       # never admitted, arrival order
    preempted: deque[State] = deque()     # admitted before, go first, never rejected
    running: list[State] = []             # admission order, oldest first
    series = Series()
    nxt, n = 0, len(trace)
    done = rejected = preemptions = preempted_tokens = frag_stalls = 0
    rejected_lens = []
    tokens_stored = 0                      # sum of running lengths (contiguous bookkeeping)
    t = 0
    t0 = time.perf_counter()
    while done + rejected < n:
        while nxt < n and trace[nxt].arrival <= t:
            waiting.append(states[nxt])
            nxt += 1
        if max_wait > 0:
            while waiting and t - waiting[0].req.arrival > max_wait:
                rejected_lens.append(waiting.popleft().req.total_len)
                rejected += 1
        # FCFS admission with head-of-line blocking
        while preempted or waiting:
            q = preempted if preempted else waiting
            s = q[0]
            if not alloc.admit(s.req, s.cur_len):
                need = alloc.need(s.req, s.cur_len)
                _, _, free, _ = alloc.snapshot(tokens_stored)
                if free >= need and not isinstance(alloc, PagedAllocator):
                    frag_stalls += 1
                break
            q.popleft()
            if s.admit_step is None:
                s.admit_step = t
            running.append(s)
            tokens_stored += s.cur_len
        # one decode step: every running request writes one token
        i = 0
        while i < len(running):
            s = running[i]
            if alloc.grow(s.req, s.cur_len + 1):
                s.generated += 1
                tokens_stored += 1
                i += 1
                continue
            victim = running.pop()            # newest admitted
            alloc.release(victim.req)
            tokens_stored -= victim.cur_len
            victim.preemptions += 1
            preemptions += 1
            preempted_tokens += victim.cur_len
            preempted.appendleft(victim)      # older victims end up in front
            # if the victim was s itself, the loop ends (i == len(running))
        stored, reserved, free, largest = alloc.snapshot(tokens_stored)
        series.util.append(stored / reserved if reserved else np.nan)
        series.occupancy.append(stored / budget)
        series.reserved.append(reserved / budget)
        series.free.append(free)
        series.largest.append(largest)
        series.running.append(len(running))
        series.queued.append(len(waiting) + len(preempted))
        still = []
        for s in running:
            if s.generated >= s.req.output_len:
                alloc.release(s.req)
                tokens_stored -= s.cur_len
                s.finish_step = t + 1
                done += 1
            else:
                still.append(s)
        running = still
        t += 1
    wall = time.perf_counter() - t0

    fin = [s for s in states if s.finish_step is not None]
    waits = np.array([s.admit_step - s.req.arrival for s in fin], dtype=float)
    lat = np.array([s.finish_step - s.req.arrival for s in fin], dtype=float)
    util = np.array(series.util, dtype=float)
    free = np.array(series.free, dtype=float)
    largest = np.array(series.largest, dtype=float)
    has_free = free > 0
    frag = np.where(has_free, 1.0 - largest / np.where(has_free, free, 1.0), 0.0)
    gen_tokens = sum(s.req.output_len for s in fin)
    reserved = np.array(series.reserved, dtype=float)
    full = reserved >= 0.9
    summary = {
        "allocator": alloc.name,
        "admitted": len(fin),
        "rejected": rejected,
        "preemptions": preemptions,
        "preempted_tokens": preempted_tokens,
        "rejected_len_mean": float(np.mean(rejected_lens)) if rejected_lens else None,
        "util_mean": float(np.nanmean(util)),
        "util_peak": float(np.nanmax(util)),
        "util_when_full": float(util[full].mean()) if full.any() else None,
        "steps_full": int(full.sum()),
        "occupancy_mean": float(np.mean(series.occupancy)),
        "occupancy_peak": float(np.max(series.occupancy)),
        "reserved_mean": float(np.mean(series.reserved)),
        "running_mean": float(np.mean(series.running)),
        "running_peak": int(np.max(series.running)),
        "free_mean_tokens": float(free.mean()),
        "largest_hole_mean_tokens": float(largest.mean()),
        "ext_frag_mean": float(frag[has_free].mean()) if has_free.any() else 0.0,
        "frag_stall_steps": frag_stalls,
        "wait_mean": float(waits.mean()) if len(waits) else None,
        "wait_p95": float(np.percentile(waits, 95)) if len(waits) else None,
        "latency_mean": float(lat.mean()) if len(lat) else None,
        "completion_step": t,
        "generated_tokens": gen_tokens,
        "tokens_per_step": gen_tokens / t if t else 0.0,
        "sim_wall_s": wall,
    }
    return summary, series


# ---- output ---------------------------------------------------------------------

TABLE_COLUMNS = {
    "allocator": "allocator",
    "admitted": "admitted",
    "rejected": "rejected",
    "preemptions": "preempt.",
    "util_mean": "util mean",
    "util_peak": "util peak",
    "util_when_full": "util when full",
    "occupancy_mean": "occupancy mean",
    "occupancy_peak": "occupancy peak",
    "ext_frag_mean": "ext. frag mean",
    "frag_stall_steps": "frag. stalls",
    "wait_mean": "wait mean",
    "wait_p95": "wait p95",
    "completion_step": "completion (steps)",
    "generated_tokens": "gen tokens",
    "tokens_per_step": "gen tok/step",
}


def table_rows(summaries: list[dict]) -> list[dict]:
    rows = []
    for s in summaries:
        row = {label: s[key] for key, label in TABLE_COLUMNS.items()}
        for key in ("util mean", "util peak", "util when full", "occupancy mean",
                    "occupancy peak", "ext. frag mean"):
            row[key] = "-" if row[key] is None else f"{100 * row[key]:.1f}%"
        rows.append(row)
    return rows


def downsample(x: list, max_points: int = 400) -> tuple[list, list]:
    step = max(1, -(-len(x) // max_points))
    idx = list(range(0, len(x), step))
    return idx, [None if (isinstance(x[i], float) and np.isnan(x[i])) else x[i] for i in idx]


def plot(path: Path, names: list[str], series: list[Series], budget: int, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"naive": "tab:red", "contiguous": "tab:orange"}
    paged_colors = iter(["tab:blue", "tab:green", "tab:purple", "tab:cyan", "tab:olive"])
    col = {n: colors.get(n) or next(paged_colors) for n in names}
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    ax = axes[0]
    for n, s in zip(names, series):
        ax.plot(np.array(s.util, dtype=float) * 100, color=col[n], lw=1, label=n)
    ax.set_ylabel("utilization %\n(tokens stored / reserved)")
    ax.set_ylim(0, 105)
    ax.legend(loc="lower right", ncol=len(names), fontsize=8)
    ax.set_title(title, fontsize=10)
    ax = axes[1]
    for n, s in zip(names, series):
        ax.plot(np.array(s.free) / budget * 100, color=col[n], lw=1, label=f"{n}: free")
        if not n.startswith("paged"):
            ax.plot(np.array(s.largest) / budget * 100, color=col[n], lw=1, ls="--",
                    label=f"{n}: largest hole")
    ax.set_ylabel("% of KV budget\n(free; dashed: largest hole)")
    ax.set_ylim(0, 105)
    ax.legend(loc="upper right", ncol=2, fontsize=7)
    ax = axes[2]
    for n, s in zip(names, series):
        ax.plot(s.running, color=col[n], lw=1, label=f"{n}: running")
        ax.plot(s.queued, color=col[n], lw=0.8, ls=":", label=f"{n}: queued")
    ax.set_ylabel("requests\n(solid running; dotted queued)")
    ax.set_xlabel("step (one decode iteration)")
    ax.legend(loc="upper right", ncol=2, fontsize=7)
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--block-sizes", default="16,32", help="paged block sizes, comma separated")
    ap.add_argument("--max-seq-len", type=int, default=2048,
                    help="model context: the naive slab size and the clip of request lengths")
    ap.add_argument("--mean-len", type=float, default=200.0,
                    help="mean total request length (log-normal, before clipping)")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma (tail weight)")
    ap.add_argument("--arrival-rate", type=float, default=0.8,
                    help="Poisson arrivals, requests per step")
    ap.add_argument("--max-wait", type=int, default=500,
                    help="steps a request may wait before it is rejected (0: never reject)")
    ap.add_argument("--watermark", type=float, default=0.01,
                    help="paged admission keeps this fraction of blocks free")
    ap.add_argument("--windows", default="0,512,512,512,512,512",
                    help="layer groups' windows for the paged-*-windows allocators (0: full attention; "
                         "default: Gemma 3 270M's six groups of three layers); '' to leave them out")
    add_options(ap, budget_tokens=32768, seed=0, out=str(RESULTS_DIR),
                helps={"budget_tokens": "KV budget in token slots, the same for every allocator"})
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    block_sizes = [int(b) for b in args.block_sizes.split(",") if b.strip()]
    if args.max_seq_len > args.budget_tokens:
        ap.error("--max-seq-len must not exceed --budget-tokens (a naive slab must fit)")
    t_start = time.perf_counter()
    trace = make_trace(args.num_requests, args.mean_len, args.sigma, args.max_seq_len,
                       args.arrival_rate, args.seed)
    lengths = np.array([r.total_len for r in trace])
    prompts = np.array([r.prompt_len for r in trace])
    trace_info = {
        "num_requests": len(trace),
        "len_mean": float(lengths.mean()),
        "len_median": float(np.median(lengths)),
        "len_p99": float(np.percentile(lengths, 99)),
        "len_max": int(lengths.max()),
        "num_clipped": int((lengths >= args.max_seq_len).sum()),
        "prompt_mean": float(prompts.mean()),
        "output_mean": float((lengths - prompts).mean()),
        "last_arrival_step": trace[-1].arrival,
        "offered_tokens_per_step": float(args.arrival_rate * (lengths - prompts).mean()),
    }

    allocators = [ContiguousAllocator("naive", args.budget_tokens, args.max_seq_len),
                  ContiguousAllocator("contiguous", args.budget_tokens, None)]
    allocators += [PagedAllocator(args.budget_tokens, b, args.watermark) for b in block_sizes]
    if args.windows:
        windows = [int(w) for w in args.windows.split(",")]
        allocators += [WindowPagedAllocator(args.budget_tokens, b, args.watermark, windows) for b in block_sizes]
    summaries, series = [], []
    for a in allocators:
        s, ser = simulate(a, trace, args.budget_tokens, args.max_wait)
        a.close()
        summaries.append(s)
        series.append(ser)

    rows = table_rows(summaries)
    out = Path(args.out)
    params = {k: getattr(args, k) for k in ("num_requests", "budget_tokens", "max_seq_len",
                                            "mean_len", "sigma", "arrival_rate", "max_wait",
                                            "watermark", "seed")}
    params["block_sizes"] = block_sizes
    params["prompt_fraction"] = [0.2, 0.8]
    data = {
        "params": params,
        "trace": trace_info,
        "allocators": summaries,
        "series": {s["allocator"]: {"step": downsample(ser.util)[0],
                                    **{k: downsample(getattr(ser, k))[1]
                                       for k in ("util", "occupancy", "reserved", "free",
                                                 "largest", "running", "queued")}}
                   for s, ser in zip(summaries, series)},
        "wall_s": time.perf_counter() - t_start,
    }
    title = (f"Allocator trace: {len(trace)} requests, budget {args.budget_tokens} tokens, "
             f"mean len {trace_info['len_mean']:.0f} (median {trace_info['len_median']:.0f}, "
             f"max {trace_info['len_max']}), {args.arrival_rate} req/step, seed {args.seed}")
    notes = (
        f"Parameters: {params}.\n\n"
        "util = tokens stored / token slots reserved (time mean over steps with anything "
        "reserved, and peak); occupancy = tokens stored / budget; ext. frag = 1 - largest free "
        "hole / total free (0 for paged: any free block is usable); frag. stalls = steps where "
        "the queue head did not fit although total free memory was enough; wait = steps from "
        "arrival to first admission (admitted requests); completion = step at which the last "
        "request finished or was rejected; rejected = waited more than max_wait steps. "
        "util when full = mean util over steps with >= 90% of the budget reserved. "
        "naive reserves max_seq_len per request (its holes are whole slabs, so its ext. frag "
        "never stalls admission); contiguous reserves the exact final length "
        "(an oracle); paged grows one block at a time and preempts (recompute) the newest "
        "request when a block is missing. paged-*-windows: the same bytes in layer groups "
        f"(windows {args.windows}), window groups giving pages back; its figures are in tokens of "
        "every layer (a token past every window costs only its full-attention groups' share). One step = "
        "one decode iteration of the running batch. See the docstring of bench/kernels/allocator_trace.py."
    )
    if not args.no_plot:
        out.mkdir(parents=True, exist_ok=True)
        plot(out / "allocator_trace.png", [s["allocator"] for s in summaries], series,
             args.budget_tokens, title)
    data["wall_s"] = time.perf_counter() - t_start
    paths = write_results("allocator_trace", data, rows, out_dir=out, title=title, notes=notes)

    print(title)
    print(markdown_table(rows))
    print(f"wrote {paths['json']}, {paths['md']}"
          + ("" if args.no_plot else f", {out / 'allocator_trace.png'}")
          + f" in {data['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
