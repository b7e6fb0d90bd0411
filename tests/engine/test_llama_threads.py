"""One Llama, many threads: every caller's answer is the one it gets alone (up to
near-ties of the logits, as in pyllama_paged/testing/agreement.py), nothing crashes, and the
pages come back. Callers share the engine's steps (engine/shared_steps.py)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from pyllama_paged.testing.agreement import NEAR_TIE
from pyllama_paged.errors import PagedError
from pyllama_paged.api.llama import Llama
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model

N_THREADS = 8
KINDS = ("completion", "chat", "n2", "stream", "embed")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("threads") / "llama.gguf", "llama", weight_type="q8_0")
    with Llama(str(path), n_ctx=256, n_threads=1, n_seq_max=16, seed=1) as model:
        yield model


def _completion_tokens(lps: dict) -> list[tuple[str, dict[str, float]]]:
    return list(zip(lps["tokens"], lps["top_logprobs"]))


def _chat_tokens(content: list[dict]) -> list[tuple[str, dict[str, float]]]:
    return [(c["token"], {t["token"]: t["logprob"] for t in c["top_logprobs"]}) for c in content]


def ask(llm: Llama, kind: str, i: int):
    """One request of the given kind; returns what to compare: [(token piece, top
    log-probabilities there)] per answer, or an embedding."""
    prompt = f"question {i}: what is {i} plus {i + 3}?"
    greedy = dict(temperature=0, max_tokens=8, repeat_penalty=1.0)
    if kind == "completion":
        out = llm.create_completion(prompt, logprobs=5, **greedy)
        return [_completion_tokens(out["choices"][0]["logprobs"])]
    if kind == "stream":
        tokens: list = []
        for chunk in llm.create_completion(prompt, logprobs=5, stream=True, **greedy):
            lps = chunk["choices"][0]["logprobs"]
            if lps:
                tokens += _completion_tokens(lps)
        return [tokens]
    if kind in ("chat", "n2"):
        out = llm.create_chat_completion([{"role": "user", "content": prompt}], logprobs=True, top_logprobs=5,
                                         n=2 if kind == "n2" else 1, **greedy)
        return [_chat_tokens(c["logprobs"]["content"]) for c in out["choices"]]
    return np.asarray(llm.embed(prompt))


def assert_same_answer(alone, got) -> None:
    """Equal, or parted at a near-tie: where the token pieces first differ, the one
    got chose is within NEAR_TIE of the best log-probability alone saw there."""
    if isinstance(alone, np.ndarray):
        np.testing.assert_allclose(got, alone, atol=1e-3)
        return
    assert len(got) == len(alone)
    for a, g in zip(alone, got):
        n = min(len(a), len(g))
        i = next((j for j in range(n) if a[j][0] != g[j][0]), None)
        if i is None:
            assert len(a) == len(g)
            continue
        tops = a[i][1]
        assert g[i][0] in tops, f"token {i}: {g[i][0]!r} is not among {sorted(tops)} (alone chose {a[i][0]!r})"
        assert max(tops.values()) - tops[g[i][0]] <= NEAR_TIE


def run_together(llm: Llama) -> dict[tuple[int, str], object]:
    """Every thread runs every kind (in its own order); returns each answer."""
    answers: dict = {}
    errors: list = []
    start = threading.Barrier(N_THREADS)

    def worker(t: int):
        try:
            start.wait()
            for k in range(len(KINDS)):
                kind = KINDS[(t + k) % len(KINDS)]
                answers[t, kind] = ask(llm, kind, t)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(N_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a caller hung"
    assert not errors, errors
    return answers


def test_eight_threads_on_one_llama_get_their_alone_answers(llm):
    alone = {(t, kind): ask(llm, kind, t) for t in range(N_THREADS) for kind in KINDS}
    for run in range(20):
        got = run_together(llm)
        assert set(got) == set(alone)
        for key, answer in got.items():
            assert_same_answer(alone[key], answer)
        assert llm.stats()["blocks_used"] == 0, f"run {run}: pages left behind"


def test_threads_share_steps(llm):
    """Concurrent callers' requests run in the same batches (fewer steps than alone)."""
    before = llm.stats()["steps"]
    for t in range(N_THREADS):
        ask(llm, "completion", t)
    alone_steps = llm.stats()["steps"] - before
    before = llm.stats()["steps"]
    start = threading.Barrier(N_THREADS)   # all submit together, however fast a step is

    def together(t):
        start.wait()
        ask(llm, "completion", t)

    threads = [threading.Thread(target=together, args=(t,)) for t in range(N_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert llm.stats()["steps"] - before < alone_steps


def test_asyncio_tasks_share_one_llama(llm):
    async def main():
        return await asyncio.gather(*(asyncio.to_thread(ask, llm, "completion", t) for t in range(N_THREADS)))

    together = asyncio.run(main())
    for t, got in enumerate(together):
        assert_same_answer(ask(llm, "completion", t), got)


def test_a_failing_callback_fails_only_its_own_request(llm):
    """A logits processor that raises ends its caller's request; the other threads finish."""
    def broken(input_ids, scores):
        raise RuntimeError("boom")

    results: dict = {}

    def good(t):
        results[t] = ask(llm, "completion", t)

    threads = [threading.Thread(target=good, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    with pytest.raises(Exception, match="boom"):
        llm.create_completion("a bad one", max_tokens=8, logits_processor=broken)
    for th in threads:
        th.join()
    for t in range(4):
        assert_same_answer(ask(llm, "completion", t), results[t])
    assert llm.stats()["blocks_used"] == 0


def test_closing_while_another_thread_generates_is_a_clean_error(tmp_path):
    path = write_tiny_model(tmp_path / "llama.gguf", "llama", weight_type="q8_0")
    llm = Llama(str(path), n_ctx=256, n_threads=1)
    outcome: list = []
    started = threading.Event()

    def long_one():
        try:
            for _ in llm.generate(llm.tokenize("hello"), temp=0):
                started.set()
            outcome.append("finished")
        except PagedError as e:
            outcome.append(str(e))

    th = threading.Thread(target=long_one)
    th.start()
    started.wait(60)
    llm.close()
    th.join(60)
    assert outcome and "closed" in outcome[0]
    with pytest.raises(PagedError, match="closed"):
        llm("x", max_tokens=2)
