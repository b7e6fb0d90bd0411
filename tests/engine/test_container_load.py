"""The thread policy in a container (issue 54): /proc/loadavg counts the whole host's runnable
tasks, so a container limited to two CPUs on a busy 64-CPU host decoded on one thread for
ever. Limited by a quota or a cpuset, the policy now reads the container's own cgroup v2:
its CPU quota caps the threads, and the CPU its other tasks used says what is free. The
cgroup trees here are files in cgroup v2's formats; the last test reads this machine's."""

import os
import time
from pathlib import Path

import pytest

from pyllama_paged.engine.worker.cgroup_cpu import CgroupCPU, ContainerLoad, container_cpus, limited
from pyllama_paged.engine.worker.thread_policy import ThreadPolicy, load_reader, runnable_others


def _tree(tmp_path: Path, quotas: dict[str, str], usage_usec: int = 0) -> CgroupCPU:
    """A cgroup v2 mount under tmp_path with this process in /pod/app; quotas: folder -> cpu.max."""
    root = tmp_path / "fs"
    app = root / "pod" / "app"
    app.mkdir(parents=True)
    for folder in (root, root / "pod", app):
        (folder / "cpu.stat").write_text(f"usage_usec {usage_usec}\nuser_usec 0\nsystem_usec 0\n")
        (folder / "cpu.max").write_text(quotas.get(str(folder.relative_to(root)), "max 100000") + "\n")
    (tmp_path / "self-cgroup").write_text("0::/pod/app\n")
    return CgroupCPU(roots=(str(tmp_path / "missing"), str(root)), proc_cgroup=str(tmp_path / "self-cgroup"))


def _set_usage(cgroup: CgroupCPU, seconds: float) -> None:
    (cgroup.folder / "cpu.stat").write_text(f"usage_usec {int(seconds * 1e6)}\nuser_usec 0\nsystem_usec 0\n")


def test_the_tightest_quota_of_the_cgroup_and_its_parents_caps_the_cpus(tmp_path):
    cgroup = _tree(tmp_path, {"pod": "150000 100000", "pod/app": "400000 100000"})
    assert cgroup.found and cgroup.quota_cpus() == 1.5
    assert container_cpus(cgroup) == min(2, len(os.sched_getaffinity(0)))
    assert limited(cgroup)


def test_no_quota_and_every_cpu_reads_the_hosts_load(tmp_path):
    cgroup = _tree(tmp_path, {})
    assert cgroup.quota_cpus() is None
    if len(os.sched_getaffinity(0)) == (os.cpu_count() or 1):
        assert not limited(cgroup) and load_reader(cgroup) is runnable_others
    assert load_reader(CgroupCPU(roots=(str(tmp_path / "none"),))) is runnable_others   # no cgroup v2 at all


def test_a_busy_host_does_not_starve_an_idle_container(tmp_path):
    host = tmp_path / "loadavg"
    host.write_text("40.0 40.0 40.0 41/900 1234\n")   # forty tasks runnable on the host
    assert runnable_others(str(host)) == 40
    cgroup = _tree(tmp_path, {"pod": "200000 100000"})
    load = load_reader(cgroup)
    assert isinstance(load, ContainerLoad)
    policy = ThreadPolicy(max_threads=2, cores=container_cpus(cgroup), read_load=load)
    chosen = [policy.threads_for_step() for _ in range(8)]
    assert chosen[-1] == min(2, container_cpus(cgroup))   # the host's forty are not the container's


def test_the_containers_own_busy_tasks_take_threads_away(tmp_path):
    cgroup = _tree(tmp_path, {"pod": "200000 100000"})
    if container_cpus(cgroup) < 2:
        pytest.skip("needs two CPUs to choose between")
    load = ContainerLoad(cgroup)
    assert load() is None   # nothing measured yet
    policy = ThreadPolicy(max_threads=2, cores=2, read_load=load)
    used, chosen, readings = 0.0, [], []
    for _ in range(ThreadPolicy.WINDOW):
        used += 30.0   # siblings in the container used 30 CPU-seconds since the last step
        _set_usage(cgroup, used)
        chosen.append(policy.threads_for_step())
        readings.append(policy.load[-1])
    assert all(r >= 2 for r in readings), readings   # far more than two CPUs' worth per second
    assert chosen[-1] == 1


def test_this_machines_cgroup_reads_its_own_cpu_use():
    cgroup = CgroupCPU()
    if not cgroup.found:
        pytest.skip("no cgroup v2 here")
    before = cgroup.usage_seconds()
    spent = time.process_time()
    while time.process_time() - spent < 0.2:   # CPU this process uses counts in its cgroup
        pass
    assert cgroup.usage_seconds() > before
