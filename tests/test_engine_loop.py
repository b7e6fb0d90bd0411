"""EngineLoop: many threads submit at once; streams, async streams, abort, idling."""

import asyncio
import threading
import time

import pytest

from pyllama_paged.engine import Engine
from pyllama_paged.engine_loop import EngineLoop
from pyllama_paged.llm_engine import LLMEngine
from pyllama_paged.model import Model
from pyllama_paged.sampling import SamplingParams
from reference.tiny_gguf import write_tiny_model


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("loop") / "llama.gguf", "llama", weight_type="q8_0")
    model = Model(path)
    engine = Engine(model, n_ctx=256, n_threads=1, n_batch=128, block_size=16, num_blocks=200)
    loop = EngineLoop(LLMEngine(engine, {2}))
    yield loop
    loop.stop()
    engine.close()
    model.close()


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
    assert results == single
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


def test_idle_loop_does_not_spin(loop):
    time.sleep(0.2)
    cpu0 = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu0 < 0.1
