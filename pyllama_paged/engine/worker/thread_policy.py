"""How many threads a step runs on, decided for the load the machine has now.

GGML's workers meet at a barrier after every op, many times a step. When the machine has
fewer free cores than the step has threads, one descheduled worker holds the others at
the barrier for a scheduler time slice: beside two busy processes, two threads on two
cores decoded 10 tokens/s where one thread decoded 58. So, when the caller did not fix the
thread count, each step runs on the cores that are free now:

- what the OS says: the runnable tasks that are not this step (Linux's /proc/loadavg,
  sampled between steps, when our own workers sleep), averaged over the last few steps; in
  a container that may use fewer CPUs than the host (a cpuset or a cgroup quota), the CPUs
  the container's other tasks kept busy since the last step instead (cgroup v2's CPU usage:
  `cgroup_cpu`), since the host's count is mostly tasks on CPUs the container never gets;
- what the steps say: seconds per token measured for each thread count and step size
  (the median of its last few steps: one step stalled by an interrupt or a page fault
  moves nothing), so that when the OS's count misleads (a competitor that mostly sleeps),
  the count that actually ran faster wins. The count next to the chosen one is tried now
  and then to keep its figure fresh; the less it wins, the more rarely. More threads than
  the OS says are free are tried only when its count varies (a competitor that sleeps at
  times): beside competitors that never sleep such a try costs a time slice at every
  barrier, up to 50x a step. A measured choice that departs from the OS's count holds
  only while the OS's count was itself measured recently: it runs again at least every
  REVISIT steps, so that a figure made stale by a passing disturbance cannot keep a quiet
  machine on fewer threads for long (it did: a 2-core machine lost 15% of its batched
  speed to it).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Callable

from ..._native import lib
from .cgroup_cpu import CgroupCPU, ContainerLoad, container_cpus, limited

MAX_THREADS = lib.PP_SAMPLER_MAX_THREADS   # the native sampler's limit (it shares the engine's thread count)
LOADAVG = "/proc/loadavg"


def cores_available() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one), at most
    its cgroup's CPU quota."""
    return container_cpus(CgroupCPU())


def default_threads() -> int:
    """The one default thread count: every CPU this process may use, at most MAX_THREADS."""
    return min(cores_available(), MAX_THREADS)


def runnable_others(path: str = LOADAVG) -> int | None:
    """Runnable tasks on the machine besides the thread asking (None: the OS does not say).
    /proc/loadavg's fourth field is "runnable/total" scheduling entities right now."""
    try:
        with open(path, "rb") as f:
            fields = f.read(256).split()
        running = int(fields[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - 1)


def load_reader(cgroup: CgroupCPU | None = None) -> Callable[[], int | None]:
    """What tells the policy how many CPUs others keep busy: the container's cgroup when the
    process may use fewer CPUs than the host, else the host's /proc/loadavg."""
    cgroup = cgroup if cgroup is not None else CgroupCPU()
    return ContainerLoad(cgroup) if limited(cgroup) else runnable_others


def _bucket(tokens: int) -> int:
    """Steps compared with one another: the same power-of-two number of tokens."""
    return max(1, tokens).bit_length()


class ThreadPolicy:
    """Chooses each step's thread count, between 1 and max_threads."""

    WINDOW = 8              # steps the OS's count is averaged over
    EXPLORE_FIRST = 32      # steps between two tries of the neighbouring count, at first
    EXPLORE_MAX = 1024      # and at most, after tries that lost
    # Trying more threads than the OS says are free can cost a scheduler time slice at each
    # barrier (a step many times its usual length), trying fewer only the lost parallelism:
    # the first kind of try is this many times rarer.
    UP_FACTOR = 8
    SAMPLES = 5             # a count's figure: the median of its last this many steps
    REVISIT = 32            # a measured choice departs from the OS's count for at most this many steps
    MARGIN = 0.9            # a measured count must be this much faster to overrule the OS
    STALE_STEPS = 512       # a figure older than this no longer overrules the OS

    def __init__(self, max_threads: int, cores: int | None = None,
                 read_load: Callable[[], int | None] | None = None):
        self.max_threads = max(1, max_threads)
        self.cores = cores if cores is not None else cores_available()
        self.read_load = read_load if read_load is not None else load_reader()
        self.load: deque[int] = deque(maxlen=self.WINDOW)
        # (bucket, threads) -> (the last SAMPLES seconds per token, the step of the last)
        self.seconds_per_token: dict[tuple[int, int], tuple[deque[float], int]] = {}
        self.steps = 0
        self.explore_every = self.EXPLORE_FIRST
        self.next_explore = self.EXPLORE_FIRST
        self.last_choice = self.last_base = self.max_threads
        self.exploring: tuple[int, int] | None = None   # (count tried, count it stood in for)
        self.decisions = {"os": 0, "measured": 0, "explore": 0}

    def os_choice(self) -> int:
        """The free cores by the OS's count (all of max_threads when it says nothing)."""
        others = self.read_load()
        if others is not None:
            self.load.append(others)
        if not self.load:
            return self.max_threads
        busy = round(sum(self.load) / len(self.load))
        return max(1, min(self.max_threads, self.cores - busy))

    def threads_for_step(self, tokens: int = 1) -> int:
        """The thread count for a step of this many tokens."""
        self.steps += 1
        base = self.os_choice()
        if base != self.last_base:
            # the load changed: what was measured under the old one no longer holds
            self.seconds_per_token.clear()
            self.explore_every = self.EXPLORE_FIRST
            self.next_explore = min(self.next_explore, self.steps + self._explore_interval(base == 1))
            self.last_base = base
        bucket = _bucket(tokens)
        choice, why = base, "os"
        best = self._measured_best(bucket, base)
        if best is not None:
            choice, why = best, "measured"
        if self.max_threads > 1 and self.steps >= self.next_explore:
            neighbour = choice - 1 if choice > 1 else choice + 1
        else:
            neighbour = None
        if neighbour is not None and neighbour > base and self._load_is_steady():
            # every reading saw the same competitors runnable: they hold their cores, and a
            # try of more threads would only stall at the barriers
            self.next_explore = self.steps + self._explore_interval(True)
            neighbour = None
        if neighbour is not None:
            # the next try is planned once this one's result is in (record)
            self.next_explore = self.steps + self._explore_interval(neighbour > base)
            self.exploring = (neighbour, choice)
            choice, why = neighbour, "explore"
        self.decisions[why] += 1
        self.last_choice = choice
        return choice

    def _measured_best(self, bucket: int, base: int) -> int | None:
        """A neighbour of base that measured clearly faster on steps of this size, if fresh."""
        mine = self._fresh(bucket, base)
        if mine is None or self.steps - self.seconds_per_token[(bucket, base)][1] > self.REVISIT:
            return None   # the OS's count runs this step, and its figure is new again
        best, best_s = None, None
        for other in (base - 1, base + 1):
            if not 1 <= other <= self.max_threads:
                continue
            theirs = self._fresh(bucket, other)
            # only a comparison overrules the OS: one side's figure alone says nothing
            if theirs is None or mine is None or theirs >= mine * self.MARGIN:
                continue
            if best_s is None or theirs < best_s:
                best, best_s = other, theirs
        return best

    def _fresh(self, bucket: int, threads: int) -> float | None:
        entry = self.seconds_per_token.get((bucket, threads))
        if entry is None or self.steps - entry[1] > self.STALE_STEPS:
            return None
        return statistics.median(entry[0])

    def record(self, threads: int, seconds: float, tokens: int) -> None:
        """What a step of tokens took on threads."""
        if tokens < 1 or seconds <= 0:
            return
        bucket = _bucket(tokens)
        per_token = seconds / tokens
        old = self.seconds_per_token.get((bucket, threads))
        samples = old[0] if old is not None else deque(maxlen=self.SAMPLES)
        samples.append(per_token)
        self.seconds_per_token[(bucket, threads)] = (samples, self.steps)
        if self.exploring is not None:
            tried, departed = self.exploring
            self.exploring = None
            reference = self._fresh(bucket, departed)
            if tried == threads and reference is not None:
                # a try that lost is repeated ever more rarely: each costs a slow step
                won = per_token < reference * self.MARGIN
                self.explore_every = self.EXPLORE_FIRST if won else min(self.EXPLORE_MAX, self.explore_every * 2)
                self.next_explore = self.steps + self._explore_interval(tried > self.last_base)

    def _load_is_steady(self) -> bool:
        """Whether the OS's count held one value over the whole window."""
        return len(self.load) == self.load.maxlen and min(self.load) == max(self.load)

    def _explore_interval(self, upward: bool) -> int:
        """Steps until the next try (a try of more threads than the OS says are free: rarer)."""
        return self.explore_every * (self.UP_FACTOR if upward else 1)

    def stats(self) -> dict:
        """What the policy decided, for `info`-style reporting and tests."""
        return {"threads": self.last_choice, "max_threads": self.max_threads, "cores": self.cores,
                "decisions": dict(self.decisions), "explore_every": self.explore_every}
