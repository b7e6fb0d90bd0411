"""A step's graph: GGML's flash attention on pages as one call per group of sequence runs
(the device path, timed here through attention="gather"), and graphs run again for steps of
the same shape. What must hold: the node and input counts of a decode step do not grow with
the number of sequences, a step of the previous step's shape runs that graph again, and any
mix of decode runs and prefill chunks (which the grouping reorders) gives the kernel's logits."""

import numpy as np
import pytest

from pyllama_paged.engine import EngineConfig, Model
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model

# Two attention paths over f16 pages: agreement to f16 rounding of the products' inputs.
LOGIT_TOLERANCE = 2e-2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("step_graph")
    # gemma3: sliding-window layers beside full ones (two layer groups, windowed masks).
    return {arch: write_tiny_model(root / f"{arch}.gguf", arch, weight_type="q8_0") for arch in ("llama", "gemma3")}


def _runner(model, attention, **kw):
    return ModelRunner(model, EngineConfig(paged=True, n_ctx=128, n_seq_max=64, n_threads=2, n_batch=128,
                                           block_size=16, attention=attention, **kw))


def _decode_stats(model, attention, n_seqs, rng):
    runner = _runner(model, attention)
    try:
        seqs = [runner.add_sequence(list(rng.integers(4, 200, size=int(rng.integers(3, 40))))) for _ in range(n_seqs)]
        for s in seqs:
            runner.prefill(s)
        for s in seqs:
            runner.append_tokens(s, [7])
        runner.step([(s, 1) for s in seqs])
        first = runner.step_stats()
        for s in seqs:
            runner.append_tokens(s, [9])
        runner.step([(s, 1) for s in seqs])
        return first, runner.step_stats()
    finally:
        runner.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_gathered_decode_step_has_the_same_graph_at_any_number_of_sequences(tiny, arch):
    rng = np.random.default_rng(3)
    # from 2 sequences: on the CPU one sequence's products over the types tinyBLAS takes run as
    # two columns (a pad and a view each, docs/batch-invariance.md), which a device's graph never has
    with Model(tiny[arch]) as model:
        seen = {n: _decode_stats(model, "gather", n, rng) for n in (2, 16, 64)}
    first = {n: (s[0]["nodes"], s[0]["inputs"]) for n, s in seen.items()}
    assert len(set(first.values())) == 1, first
    for n, (_, second) in seen.items():
        # the next decode step has the same shape (same runs, same key bucket): no rebuild
        assert second["reused"], (n, second)
        assert (second["nodes"], second["inputs"]) == first[2]


def test_the_kernel_path_runs_a_decode_graph_again(tiny):
    model = Model(tiny["llama"])
    try:
        first, second = _decode_stats(model, "kernel", 8, np.random.default_rng(4))
    finally:
        model.close()
    assert not first["reused"] and second["reused"]
    assert second["builds"] == first["builds"]


def test_a_step_of_another_shape_builds_its_own_graph(tiny):
    model = Model(tiny["llama"])
    runner = _runner(model, "gather")
    try:
        a, b = runner.add_sequence([5, 6, 7]), runner.add_sequence([8, 9, 10, 11, 12, 13, 14, 15])
        runner.step([(a, 3)])
        runner.step([(b, 2)])             # other token count (and no logits: not the prompt's end)
        assert not runner.step_stats()["reused"]
        runner.step([(b, 2)])             # same shape again
        assert runner.step_stats()["reused"]
        builds = runner.step_stats()["builds"]
        runner.append_tokens(a, [4])
        runner.step([(a, 1)])
        assert not runner.step_stats()["reused"] and runner.step_stats()["builds"] == builds + 1
    finally:
        runner.close()
        model.close()


def _mixed_logits(model, attention):
    """Steps mixing decode runs and prefill chunks of several lengths, in an order the
    grouping by query count must undo; every row's logits."""
    rng = np.random.default_rng(7)
    runner = _runner(model, attention)
    out = []
    try:
        prompts = [list(rng.integers(4, 200, size=n)) for n in (30, 9, 41, 5, 22)]
        seqs = [runner.add_sequence(p) for p in prompts]
        for s in seqs[::2]:
            runner.prefill(s)
        for s in seqs[::2]:
            runner.append_tokens(s, [11])
        # decode, chunk of 5, decode, chunk of 3, decode (then the rest of the chunks)
        out.append(runner.step([(seqs[0], 1), (seqs[1], 5), (seqs[2], 1), (seqs[3], 3), (seqs[4], 1)]).copy())
        out.append(runner.step([(seqs[3], 2), (seqs[1], 4)]).copy())
        for s in seqs:
            runner.append_tokens(s, [12, 13])
        out.append(runner.step([(s, 2) for s in seqs]).copy())   # one group of equal chunks
        for s in seqs:
            runner.append_tokens(s, [14])
        out.append(runner.step([(s, 1) for s in seqs]).copy())
        return np.concatenate(out)
    finally:
        runner.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_grouped_flash_attention_gives_the_kernels_logits(tiny, arch):
    with Model(tiny[arch]) as model:
        want, got = _mixed_logits(model, "kernel"), _mixed_logits(model, "gather")
    assert got.shape == want.shape
    assert np.isfinite(got).all()
    spread = want.max() - want.min()
    assert np.abs(got - want).max() / spread < LOGIT_TOLERANCE
    # each row is its own sequence's: rows put back in the wrong order would not agree
    assert np.abs(got[:, None, :] - want[None, :, :]).max(axis=2).argmin(axis=1).tolist() == list(range(len(want)))


def test_argmax_ids_computed_in_the_step_are_the_logits_argmax(tiny):
    model = Model(tiny["gemma3"])
    runner = _runner(model, "gather")
    try:
        seqs = [runner.add_sequence([5 + i, 6, 7, 8 + i]) for i in range(3)]
        runner.step([(s, 4) for s in seqs])
        assert runner.step_argmax() is None            # the head is on the CPU: no ids by default
        runner.set_argmax("always")
        for s in seqs:
            runner.append_tokens(s, [9])
        logits, _ = runner.execute(np.array([(s.handle, 4, 1) for s in seqs], dtype=np.int32), argmax_only=True)
        ids = runner.step_argmax()
        assert ids.tolist() == logits.argmax(axis=1).tolist()   # host logits come back all the same
        with pytest.raises(Exception, match="argmax mode"):
            runner.set_argmax("sometimes")
    finally:
        runner.close()
        model.close()


def _greedy_texts(path, argmax: str, extra_params=None):
    from pyllama_paged.engine import EngineConfig, LLMEngine, SamplingParams

    model = Model(path)
    engine = LLMEngine.from_config(EngineConfig(n_ctx=128, n_threads=2, block_size=16, kv_tokens=1024),
                                   model=model, eot_ids=[])
    engine.runner.set_argmax(argmax)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in range(3)]
        if extra_params:
            params.append(extra_params)
        ids = [engine.add_request([4 + i, 20, 30 + i], p).request_id for i, p in enumerate(params)]
        got = {i: [] for i in ids}
        while engine.has_work():
            for out in engine.step():
                got[out.request_id] += [e.token_id for e in out.events]
        assert (engine.post.argmax_draws > 0) == (argmax == "always" and extra_params is None)
        return [got[i] for i in ids]
    finally:
        engine.close()
        model.close()


def test_greedy_requests_drawn_from_the_steps_argmax_answer_as_the_sampler_does(tiny):
    from pyllama_paged.engine import SamplingParams

    want = _greedy_texts(tiny["llama"], "never")
    assert _greedy_texts(tiny["llama"], "always") == want
    # a request that needs its logits (a penalty) beside them: the sampler draws every row
    penalised = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repeat_penalty=1.5)
    mixed = _greedy_texts(tiny["llama"], "always", penalised)
    assert mixed[:3] == want and mixed[3] == _greedy_texts(tiny["llama"], "never", penalised)[3]


def _long_decode_logits(model, attention, n_threads):
    """One sequence of 600 prompt tokens, then three decode steps: with fewer sequences than
    threads and this many keys the kernel splits each key range (one op, the last thread to
    finish merging); the logits of each step and whether it reused the graph."""
    runner = ModelRunner(model, EngineConfig(paged=True, n_ctx=640, n_threads=n_threads, n_batch=128, block_size=16,
                                             attention=attention))
    try:
        seq = runner.add_sequence([(5 * i) % 190 + 4 for i in range(600)])
        runner.prefill(seq)
        rows, reused = [], []
        for token in (7, 8, 9):
            runner.append_tokens(seq, [token])
            rows.append(runner.step([(seq, 1)])[0].copy())
            reused.append(runner.step_stats()["reused"])
        return np.stack(rows), reused
    finally:
        runner.close()


@pytest.mark.parametrize("n_threads", [3, 4])   # the tiny llama has 2 KV heads
def test_a_split_key_range_is_merged_again_in_every_step_that_reuses_the_graph(tiny, n_threads):
    model = Model(tiny["llama"])
    try:
        got, reused = _long_decode_logits(model, "kernel", n_threads)
        want, _ = _long_decode_logits(model, "gather", n_threads)
    finally:
        model.close()
    assert reused[1:] == [True, True]
    assert np.isfinite(got).all()
    # the reused graph's steps merge too (a merge counter left from the step before would skip it)
    assert np.abs(got - want).max() / (want.max() - want.min()) < LOGIT_TOLERANCE
