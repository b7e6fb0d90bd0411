"""The CPUs a container gives this process, and how busy the container's other tasks keep
them, from cgroup v2 (Linux): what the thread policy reads instead of the host's load when
the process may not use every CPU of the host.

/proc/loadavg counts the runnable tasks of the whole host. In a container limited to a few
CPUs (a cpuset, or a `cpu.max` quota) on a big, busy host, that count is mostly tasks that
never run on the container's CPUs: a 2-CPU container beside a host load of 40 would decode on
one thread forever. There the load that matters is the container's own: the CPU time its
cgroup used between two readings (`cpu.stat` usage_usec), less this process's own, per
second of wall time, is the number of CPUs its other tasks kept busy. A process that may use
every host CPU (no cpuset narrower than the host, no quota) keeps reading the host's load.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

# where cgroup v2 is mounted: alone, or beside v1 ("hybrid")
CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
PROC_CGROUP = "/proc/self/cgroup"


def _read(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("ascii", "replace")
    except OSError:
        return None


class CgroupCPU:
    """This process's cgroup v2 folder (None when there is none to read) and its CPU files."""

    def __init__(self, roots: tuple[str, ...] = CGROUP_ROOTS, proc_cgroup: str = PROC_CGROUP):
        self.root: Path | None = None
        self.folder: Path | None = None
        text = _read(Path(proc_cgroup)) or ""
        relative = next((line[3:].strip() for line in text.splitlines() if line.startswith("0::")), None)
        if relative is None:
            return
        for root in roots:
            folder = Path(root) / relative.lstrip("/")
            if (folder / "cpu.stat").is_file():
                self.root, self.folder = Path(root), folder
                return

    @property
    def found(self) -> bool:
        """Whether this process's cgroup v2 folder was found."""
        return self.folder is not None

    def quota_cpus(self) -> float | None:
        """The CPUs `cpu.max` allows (the tightest quota of this cgroup and its parents); None: no quota."""
        if self.folder is None:
            return None
        tightest = None
        folder = self.folder
        while True:
            fields = (_read(folder / "cpu.max") or "").split()
            if len(fields) == 2 and fields[0] != "max":
                try:
                    cpus = int(fields[0]) / int(fields[1])
                except (ValueError, ZeroDivisionError):
                    cpus = None
                if cpus is not None and cpus > 0:
                    tightest = cpus if tightest is None else min(tightest, cpus)
            if folder == self.root or folder.parent == folder:
                return tightest
            folder = folder.parent

    def usage_seconds(self) -> float | None:
        """CPU seconds every task of the cgroup used so far (`cpu.stat` usage_usec)."""
        if self.folder is None:
            return None
        for line in (_read(self.folder / "cpu.stat") or "").splitlines():
            name, _, value = line.partition(" ")
            if name == "usage_usec":
                try:
                    return int(value) / 1e6
                except ValueError:
                    return None
        return None


def host_cpus() -> int:
    """The host's CPU count."""
    return os.cpu_count() or 1


def affinity_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a cpuset narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):   # not on Linux
        return host_cpus()


def container_cpus(cgroup: CgroupCPU) -> int:
    """The CPUs this process may use: its affinity, at most its cgroup's quota (rounded up)."""
    quota = cgroup.quota_cpus()
    cpus = affinity_cpus()
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


class ContainerLoad:
    """CPUs kept busy by the cgroup's other tasks between two calls (the first call: None,
    nothing measured yet); None too when the cgroup does not say."""

    def __init__(self, cgroup: CgroupCPU, clock=time.monotonic, own_cpu=time.process_time):
        self.cgroup, self.clock, self.own_cpu = cgroup, clock, own_cpu
        self._last: tuple[float, float, float] | None = None

    def __call__(self) -> int | None:
        usage = self.cgroup.usage_seconds()
        if usage is None:
            return None
        now, own = self.clock(), self.own_cpu()
        last, self._last = self._last, (now, usage, own)
        if last is None or now <= last[0]:
            return None
        others = (usage - last[1]) - (own - last[2])
        return max(0, round(others / (now - last[0])))


def limited(cgroup: CgroupCPU) -> bool:
    """Whether this process may use fewer CPUs than the host has (a cpuset or a quota), and
    the cgroup can be read: then its load, not the host's, says what is free."""
    return cgroup.found and (affinity_cpus() < host_cpus() or cgroup.quota_cpus() is not None)
