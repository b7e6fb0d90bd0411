"""The thread policy's decisions (issue 40): steps run on the cores free now, measured
figures overrule the OS's count only by comparison, and an engine whose thread count was
not fixed really changes its pool. Decisions only: nothing here times anything."""

from collections import deque
from pathlib import Path

import pytest

from pyllama_paged.engine import EngineConfig, Model, SamplingParams, build_engine
from pyllama_paged.engine.worker.thread_policy import ThreadPolicy, default_threads, runnable_others
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model


class Load:
    """Runnable tasks besides ours, as the OS would report them."""

    def __init__(self, others: int | None = 0, cycle: list[int] | None = None):
        self.others, self.cycle, self.reads = others, cycle, 0

    def __call__(self):
        self.reads += 1
        return self.cycle[self.reads % len(self.cycle)] if self.cycle else self.others


def run(policy: ThreadPolicy, steps: int, seconds_per_token: dict[int, float], tokens: int = 1) -> list[int]:
    """Drive the policy as the runner does; each step takes what the table says for its count."""
    chosen = []
    for _ in range(steps):
        threads = policy.threads_for_step(tokens)
        chosen.append(threads)
        policy.record(threads, seconds_per_token[threads] * tokens, tokens)
    return chosen


def test_quiet_machine_uses_every_core():
    policy = ThreadPolicy(max_threads=2, cores=2, read_load=Load(0))
    chosen = run(policy, 200, {1: 0.012, 2: 0.008})
    assert chosen.count(2) >= 190   # the tries of 1 thread lose, and grow rarer
    assert policy.explore_every > ThreadPolicy.EXPLORE_FIRST


@pytest.mark.parametrize("busy, expected", [(1, 1), (2, 1), (5, 1)])
def test_busy_processes_take_cores_away(busy, expected):
    policy = ThreadPolicy(max_threads=2, cores=2, read_load=Load(busy))
    # as measured beside busy processes: two threads lose a time slice at every barrier (up
    # to 50x a step), and competitors that are always runnable keep their cores: never tried
    chosen = run(policy, 2000, {1: 0.013, 2: 0.5})
    assert chosen == [expected] * 2000


def test_a_big_machine_leaves_the_busy_cores():
    policy = ThreadPolicy(max_threads=16, cores=16, read_load=Load(4))
    assert policy.threads_for_step() == 12


def test_measured_speed_overrules_a_misleading_count():
    # the OS counts a competitor that sleeps at times (runnable in 3 readings of 4): it says
    # 1 core is free, but 2 threads measured clearly faster, so the policy goes with that
    policy = ThreadPolicy(max_threads=2, cores=2, read_load=Load(cycle=[1, 1, 0, 1]))
    chosen = run(policy, 600, {1: 0.012, 2: 0.006})
    assert chosen[-100:].count(2) >= 95
    assert policy.decisions["measured"] > 0


def test_one_stalled_step_does_not_send_a_quiet_machine_to_fewer_threads():
    # a step stalled by an interrupt or a page fault, right after a try of 1 thread left a
    # fresh figure for it: a running average took the stall in and ran 1 thread until the
    # next try, hundreds of steps later (15% of a quiet 2-core machine's batched speed)
    policy = ThreadPolicy(max_threads=2, cores=2, read_load=Load(0))
    chosen = run(policy, ThreadPolicy.EXPLORE_FIRST + 4, {1: 0.012, 2: 0.008})
    assert 1 in chosen   # the try happened
    threads = policy.threads_for_step()
    assert threads == 2
    policy.record(threads, 0.2, 1)   # the stalled step
    chosen = run(policy, 200, {1: 0.012, 2: 0.008})
    assert chosen.count(2) >= 195


def test_a_measured_departure_from_the_os_count_revisits_it():
    # the OS's count runs at least every REVISIT steps while measurements overrule it, so
    # its figure cannot go stale and hold the departure after the disturbance passed
    policy = ThreadPolicy(max_threads=2, cores=2, read_load=Load(cycle=[1, 1, 0, 1]))
    chosen = run(policy, 600, {1: 0.012, 2: 0.006})
    tail = chosen[200:]
    ones = [i for i, t in enumerate(tail) if t == 1]
    assert ones and all(b - a <= ThreadPolicy.REVISIT + 1 for a, b in zip(ones, ones[1:]))
    assert len(ones) <= len(tail) // ThreadPolicy.REVISIT + 2   # and no more often than that


def test_one_sided_figures_do_not_overrule_the_os():
    policy = ThreadPolicy(max_threads=2, cores=2, read_load=Load(0))
    policy.seconds_per_token[(1, 1)] = (deque([0.001]), 0)   # only 1 thread was ever measured
    assert policy.threads_for_step() == 2


def test_the_load_leaving_brings_the_cores_back_soon():
    load = Load(1)
    policy = ThreadPolicy(max_threads=2, cores=2, read_load=load)
    assert set(run(policy, 2000, {1: 0.013, 2: 0.05})) == {1}   # steady competitors: 2 never tried
    load.others = 0
    chosen = run(policy, 3 * ThreadPolicy.WINDOW + ThreadPolicy.EXPLORE_FIRST, {1: 0.012, 2: 0.007})
    assert chosen[-ThreadPolicy.WINDOW:] == [2] * ThreadPolicy.WINDOW


def test_one_thread_at_most_never_explores():
    policy = ThreadPolicy(max_threads=1, cores=8, read_load=Load(0))
    assert set(run(policy, 100, {1: 0.01})) == {1}


def test_no_os_count_means_the_maximum():
    policy = ThreadPolicy(max_threads=4, cores=4, read_load=Load(None))
    assert policy.threads_for_step() == 4


def test_the_os_count_reads_loadavg(tmp_path):
    fake = tmp_path / "loadavg"
    fake.write_text("0.52 0.58 0.59 3/1234 56789\n")
    assert runnable_others(str(fake)) == 2   # three runnable, one of them the reader
    fake.write_text("garbage\n")
    assert runnable_others(str(fake)) is None
    assert runnable_others(str(tmp_path / "missing")) is None
    if Path("/proc/loadavg").exists():
        assert runnable_others() is not None
    assert 1 <= default_threads() <= 64


def test_an_engine_without_fixed_threads_resizes_its_pool(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", "gemma3")
    load = Load(0)
    model = Model(path)
    try:
        engine = build_engine(EngineConfig(model_path=path, n_ctx=128, n_threads=2, adapt_threads=True), model)
        try:
            policy = engine.runner.thread_policy
            assert policy is not None and policy.max_threads == 2
            policy.read_load, policy.cores = load, 2
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            def generate(prompt):
                engine.add_request(prompt, params)
                while engine.has_work():
                    engine.step()

            generate([1, 2, 3])
            assert engine.runner.n_threads == 2
            load.others = 1
            policy.load.clear()
            generate([4, 5, 6])
            assert engine.runner.n_threads == 1   # the pool really shrank
        finally:
            engine.close()
        fixed = build_engine(EngineConfig(model_path=path, n_ctx=128, n_threads=2), model)
        try:
            assert fixed.runner.thread_policy is None   # a given count stays exact
        finally:
            fixed.close()
    finally:
        model.close()


def test_llama_adapts_unless_given_a_count(tmp_path):
    from pyllama_paged import Llama

    path = write_tiny_model(tmp_path / "tiny.gguf", "gemma3")
    with Llama(path, n_ctx=128) as llm:
        policy = llm.llm_engine.runner.thread_policy
        assert policy is not None and policy.max_threads == default_threads()
    with Llama(path, n_ctx=128, n_threads=1) as llm:
        assert llm.llm_engine.runner.thread_policy is None and llm.n_threads == 1
