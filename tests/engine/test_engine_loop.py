"""EngineLoop: many threads submit at once; streams, async streams, abort, idling."""

import asyncio
import threading
import time

import pytest

from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.engine import EngineConfig, EngineLoop, LLMEngine, Model, SamplingParams
from pyllama_paged.errors import PagedError
from pyllama_paged.testing.agreement import assert_greedy_agree, engine_logits
from pyllama_paged.testing.loop_control import finishes, paused
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model


def running_loop(directory):
    """An EngineLoop on a tiny llama model; stops and frees everything when done."""
    model = Model(write_tiny_model(directory / "llama.gguf", "llama", weight_type="q8_0"))
    runner = ModelRunner(model, EngineConfig(n_ctx=256, n_threads=1, n_batch=128, block_size=16, num_blocks=200))
    loop = EngineLoop(LLMEngine(runner, {2}))
    yield loop
    loop.stop()
    runner.close()
    model.close()


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    yield from running_loop(tmp_path_factory.mktemp("loop"))


def tokens_of(stream):
    out = []
    for o in stream:
        out += [e.token_id for e in o.events]
    return out


def test_many_threads_get_the_single_user_answers(loop):
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = [[5 + i, 40 + i, 90] for i in range(12)]
    single = [tokens_of(loop.submit(p, params)) for p in prompts]
    results = [None] * len(prompts)

    def worker(i):
        results[i] = tokens_of(loop.submit(prompts[i], params))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # equal to each answer alone, up to near-ties (pyllama_paged/testing/agreement.py)
    logits_of = lambda ids: loop.call(lambda llm: engine_logits(llm.runner)(ids))
    for prompt, alone, got in zip(prompts, single, results):
        assert_greedy_agree(prompt, alone, got, logits_of, {2})
    assert loop.call(lambda llm: llm.stats()["blocks_used"]) == 0


def test_async_stream(loop):
    async def main():
        stream = loop.submit([7, 8, 9], SamplingParams(max_tokens=5, temperature=0))
        return [e.token_id async for o in stream for e in o.events]
    assert len(asyncio.run(main())) == 5


def test_abort_mid_stream_frees_pages(loop):
    stream = loop.submit(list(range(10, 60)), SamplingParams(max_tokens=200, temperature=0))
    it = iter(stream)
    next(it)
    stream.abort()
    rest = list(it)
    assert len(rest) < 199
    assert loop.call(lambda llm: llm.stats()["blocks_used"]) == 0


def test_bad_request_gets_an_error_output(loop):
    stream = loop.submit(list(range(300)), SamplingParams(max_tokens=1))
    outs = list(stream)
    assert outs[-1].finished and "does not fit" in outs[-1].error


def thread_cpu_ticks(thread: threading.Thread) -> int:
    """User + system CPU time of one thread, in clock ticks (Linux /proc)."""
    fields = open(f"/proc/self/task/{thread.native_id}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_idle_loop_does_not_spin(loop):
    # The loop thread's own CPU time over half a second: a thread that spins
    # burns ~50 ticks whatever the CPU; a sleeping one none.
    before = thread_cpu_ticks(loop._thread)
    time.sleep(0.5)
    assert thread_cpu_ticks(loop._thread) - before <= 2


def test_abort_before_admission_never_runs(loop):
    with paused(loop):
        stream = loop.submit(list(range(10, 60)), SamplingParams(max_tokens=200, temperature=0))
        stream.abort()
    assert sum(len(o.events) for o in stream) == 0
    assert loop.call(lambda llm: (llm.has_work(), llm.stats()["blocks_used"])) == (False, 0)


def test_a_request_that_fails_to_add_fails_alone(loop):
    with paused(loop):
        good = loop.submit([5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
        bad = loop.submit([5, 10 ** 6], SamplingParams(max_tokens=8))
        also_bad = loop.submit([5, "x"], SamplingParams(max_tokens=8))
    assert "vocabulary" in finishes(lambda: list(bad))[-1].error
    assert "integers" in finishes(lambda: list(also_bad))[-1].error
    assert sum(len(o.events) for o in finishes(lambda: list(good))) == 8


def test_a_request_id_in_flight_is_refused(loop):
    with paused(loop):
        first = loop.submit([5, 6], SamplingParams(max_tokens=2), request_id="same")
        with pytest.raises(PagedError, match="already in flight"):
            loop.submit([5, 6], SamplingParams(max_tokens=2), request_id="same")
    assert sum(len(o.events) for o in first) == 2


@pytest.fixture
def own_loop(tmp_path):
    yield from running_loop(tmp_path)


def test_calls_after_stop_raise_instead_of_waiting(own_loop):
    own_loop.stop()
    with pytest.raises(PagedError, match="stopped"):
        finishes(lambda: own_loop.call(lambda llm: 1))
    with pytest.raises(PagedError, match="stopped"):
        own_loop.submit([5, 6], SamplingParams(max_tokens=2))
    own_loop.abort("anything")   # a no-op, not an error


def test_work_queued_when_the_loop_stops_gets_an_error(own_loop):
    results = {}
    with paused(own_loop):
        stream = own_loop.submit([5, 6, 7], SamplingParams(max_tokens=50))
        waiter = threading.Thread(target=lambda: results.update(
            call=finishes(lambda: pytest.raises(PagedError, own_loop.call, lambda llm: 1))))
        waiter.start()
        stopper = threading.Thread(target=own_loop.stop)
        stopper.start()
        while not own_loop._stopped:   # stop() has been asked before the loop resumes
            time.sleep(0.01)
    stopper.join()
    waiter.join()
    assert "stopped" in str(results["call"].value)
    with pytest.raises(PagedError, match="stopped"):
        finishes(lambda: list(stream))


def test_long_work_runs_in_pieces_between_steps(loop):
    """run_in_steps: a step of the running streams goes between each piece of long
    work (prompt scoring), so a stream keeps moving while it runs."""
    from pyllama_paged.engine.prompt_logprobs import prompt_logprobs, score_prompt
    prompt = [(7 * i) % 200 + 3 for i in range(150)]   # five 32-row pieces
    stream = loop.submit([5, 6, 7], SamplingParams(max_tokens=60, temperature=0))
    steps_seen = []

    def scoring(llm):
        pieces = score_prompt(llm.runner, prompt, 3)
        while True:
            steps_seen.append(llm.num_steps)
            try:
                next(pieces)
            except StopIteration as done:
                return done.value
            yield

    got = loop.run_in_steps(scoring).result(timeout=120)
    tokens_of(stream)
    want = loop.call(lambda llm: prompt_logprobs(llm.runner, prompt, 3))
    assert len(got) == len(want) == len(prompt)
    for (lp_a, top_a), (lp_b, top_b) in zip(got[1:], want[1:]):
        assert abs(lp_a - lp_b) < 1e-4 and list(top_a) == list(top_b)
    assert len(steps_seen) == 5 and len(set(steps_seen)) == 5   # a step between every two pieces
    assert loop.call(lambda llm: llm.stats()["blocks_used"]) == 0


def test_cancelled_long_work_frees_its_pages(loop):
    from pyllama_paged.engine.prompt_logprobs import score_prompt
    started = threading.Event()

    def scoring(llm):
        pieces = score_prompt(llm.runner, list(range(3, 200)), 0)
        next(pieces)
        started.set()
        while True:   # never finishes on its own
            yield

    future = loop.run_in_steps(scoring)
    assert started.wait(30)
    assert loop.call(lambda llm: llm.stats()["blocks_used"]) > 0
    assert future.cancel()
    loop.call(lambda llm: None)   # the loop passes its tasks once between two calls
    assert loop.call(lambda llm: llm.stats()["blocks_used"]) == 0
