"""The continuous-batching runner on a tiny model: batching, preemption,
prefix caching, n>1 copy-on-write, beam search, abort."""

import numpy as np
import pytest

from pyllama_paged.errors import ComputeError, PagedError

from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.engine import MAX_BEAM_WIDTH, EngineConfig, KVGroups, LLMEngine, SamplingParams, SchedulerConfig
from pyllama_paged.engine.worker.sampler import log_softmax
from pyllama_paged.engine.sched.step_cost import StepCostModel, decode_columns
from pyllama_paged.testing.agreement import run_to_completion, assert_greedy_agree, engine_logits

EOT = {1}


def make_engine(model, num_blocks=400, mode="recompute", budget=64, paged=True, n_seq_max=1,
                free_windows=False):
    """An engine on the tiny model. num_blocks counts blocks of every layer (the
    tests' sizes assume that); with free_windows the pool is split into layer
    groups, the same bytes in num_blocks * groups smaller blocks."""
    runner = ModelRunner(model, EngineConfig(paged=paged, n_ctx=256, n_threads=1, n_batch=budget, block_size=16,
                                             num_blocks=num_blocks * groups_of(model) if paged and free_windows else
                         num_blocks if paged else None,
                                             n_seq_max=n_seq_max, free_window_blocks=free_windows))
    return LLMEngine(runner, EOT, SchedulerConfig(max_num_batched_tokens=budget, preemption_mode=mode))


def groups_of(model):
    return KVGroups.for_windows(model.config.layer_window).n_groups


def run_all(llm, prompts, params):
    return run_to_completion(llm, prompts, params)[0]


PROMPTS = [list(np.random.default_rng(i).integers(4, 300, size=n)) for i, n in
           enumerate([5, 17, 33, 48, 9, 60, 21, 40])]
GREEDY = SamplingParams(max_tokens=40, temperature=0)


def assert_agree_with_alone(model, prompts, got, alone):
    """Each greedy answer equals the one computed alone, up to near-ties (pyllama_paged/testing/agreement.py)."""
    llm = make_engine(model)
    logits_of = engine_logits(llm.runner)
    for prompt, g, a in zip(prompts, got, alone):
        assert set(g) == {0}
        assert_greedy_agree(prompt, a[0], g[0], logits_of, EOT)
    llm.runner.close()


@pytest.fixture(scope="module")
def alone(model):
    out = []
    for p in PROMPTS:
        llm = make_engine(model)
        out.append(run_all(llm, [p], GREEDY)[0])
        llm.runner.close()
    return out


def test_continuous_batching_equals_each_request_alone(model, alone):
    llm = make_engine(model)
    assert_agree_with_alone(model, PROMPTS, run_all(llm, PROMPTS, GREEDY), alone)
    llm.runner.close()


def test_slab_baseline_batches_too(model):
    # GGML's flash attention rounds differently from our kernel: compare slab to slab
    single = []
    for p in PROMPTS[:4]:
        llm = make_engine(model, paged=False)
        single.append(run_all(llm, [p], GREEDY)[0])
        llm.runner.close()
    llm = make_engine(model, paged=False, n_seq_max=3)
    assert_agree_with_alone(model, PROMPTS[:4], run_all(llm, PROMPTS[:4], GREEDY), single)
    llm.runner.close()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_and_frees_everything(model, alone, mode):
    llm = make_engine(model, num_blocks=14, mode=mode)
    assert_agree_with_alone(model, PROMPTS, run_all(llm, PROMPTS, GREEDY), alone)
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["blocks_used"] == 0 and stats["blocks_free"] + stats["blocks_cached"] == 14
    llm.runner.close()


def test_swap_space_bounds_host_memory(model, alone):
    """Swapped KV never holds more host bytes than swap_space_bytes: past it, a
    preemption recomputes instead; answers and pages as with unbounded swap."""
    llm = make_engine(model, num_blocks=14, mode="swap")
    budget = 4 * llm.runner.block_bytes
    llm.scheduler.config.swap_space_bytes = budget
    requests = [llm.add_request(p, GREEDY) for p in PROMPTS]
    outputs = {r.request_id: [] for r in requests}
    most = swaps = 0
    while llm.has_work():
        for out in llm.step():
            outputs[out.request_id] += [e.token_id for e in out.events]
        most = max(most, llm.scheduler.swapped_bytes)
        swaps += bool(llm.scheduler.swapped_bytes)
    assert 0 < most <= budget and swaps > 0   # it did swap, within the budget
    assert llm.scheduler.swapped_bytes == 0
    assert_agree_with_alone(model, PROMPTS, [{0: outputs[r.request_id]} for r in requests], alone)
    assert llm.stats()["blocks_used"] == 0 and llm.stats()["preemptions"] > swaps_seen(llm)
    llm.runner.close()


def swaps_seen(llm) -> int:
    return llm.scheduler.num_swaps


def test_prefix_cache_skips_shared_prefill(model):
    llm = make_engine(model)
    system = list(range(100, 164))                        # 4 full blocks
    run_all(llm, [system + [5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    before = llm.num_computed_tokens
    run_all(llm, [system + [8, 9]], SamplingParams(max_tokens=2, temperature=0))
    # only the 2 new prompt tokens and the 1 decode step were computed
    assert llm.num_computed_tokens - before == 2 + 1
    assert llm.stats()["prefix_hits"] == 4
    llm.runner.close()


def test_n4_shares_prompt_pages_and_copies_only_the_last_block(model):
    llm = make_engine(model, num_blocks=100)
    prompt = list(range(10, 50))                          # 2 full blocks + 8 tokens
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3, n=4)
    request = llm.add_request(prompt, params)
    llm.step()                                            # prefill, sample 4, fork 3
    s = llm.stats()
    assert len(request.seqs) == 4
    assert (s["blocks_used"], s["blocks_shared"]) == (3, 3)   # the prompt's pages, held once
    llm.step()                                            # each writes its own token
    s = llm.stats()
    assert s["cow_copies"] == 3                           # the partial last block, for 3 of 4
    assert (s["blocks_used"], s["blocks_shared"]) == (6, 2)
    while llm.has_work():
        llm.step()
    outs = [tuple(seq.output_ids) for seq in request.seqs]
    assert len(set(outs)) > 1                             # samples differ
    assert llm.stats()["blocks_used"] == 0
    llm.runner.close()


def from_scratch_logprobs(runner):
    """logprobs(ids): next-token log-probabilities after ids, recomputed from scratch."""

    def logprobs(ids):
        seq = runner.add_sequence(ids)
        out = log_softmax(runner.prefill(seq))
        runner.free(seq)
        runner.kv.pool.reset_prefix_cache()
        return out

    return logprobs


def reference_beam_search(model, prompt, width, max_tokens, length_penalty=1.0):
    """Textbook beam search: every hypothesis recomputed from scratch, no sharing."""
    runner = ModelRunner(model, EngineConfig(n_ctx=256, n_threads=1, n_batch=256, block_size=16, num_blocks=64))
    logprobs = from_scratch_logprobs(runner)
    beams = [(0.0, [])]
    finished = []
    for _ in range(max_tokens):
        cands = []
        for score, out in beams:
            lp = logprobs(prompt + out)
            for tok in np.argpartition(-lp, 2 * width)[:2 * width]:
                cands.append((score + float(lp[tok]), out + [int(tok)]))
        cands.sort(key=lambda c: -c[0])
        beams = []
        for score, out in cands:
            if len(beams) == width:
                break
            if out[-1] in EOT:
                finished.append((score, out))
            else:
                beams.append((score, out))
        if len(finished) >= width:
            break
    else:
        finished += beams
    runner.close()
    ranked = sorted(((s / len(o) ** length_penalty, o) for s, o in finished), key=lambda b: -b[0])
    return [(o, s) for s, o in ranked[:width]]


@pytest.mark.parametrize("width", [2, 4, MAX_BEAM_WIDTH])   # the maximum: 2 x width top entries per row
def test_beam_search_matches_reference(model, width):
    prompt = list(range(20, 45))
    llm = make_engine(model)
    request = llm.add_request(prompt, SamplingParams(max_tokens=6, beam_width=width))
    final = None
    while llm.has_work():
        for out in llm.step():
            if out.finished:
                final = out
    want = reference_beam_search(model, prompt, width, 6)
    # Every beam's score, recomputed from scratch without shared pages, is what
    # the runner reported: forks and copy-on-write kept each beam's KV right.
    runner = ModelRunner(model, EngineConfig(n_ctx=256, n_threads=1, n_batch=256, block_size=16, num_blocks=64))
    logprobs = from_scratch_logprobs(runner)
    for tokens, score in final.beams:
        total = sum(float(logprobs(prompt + tokens[:i])[tok]) for i, tok in enumerate(tokens))
        assert abs(total / len(tokens) - score) < 1e-3
    runner.close()
    # The same hypotheses as the textbook search; rounding in other batch shapes
    # may only swap hypotheses of nearly equal score, so compare the scores.
    assert len(final.beams) == len(want)
    assert np.allclose([b[1] for b in final.beams], [w[1] for w in want], atol=0.05)
    assert llm.stats()["blocks_used"] == 0
    llm.runner.close()


def test_abort_frees_pages_at_once(model):
    llm = make_engine(model)
    request = llm.add_request(list(range(10, 80)), SamplingParams(max_tokens=100, temperature=0))
    llm.step()
    llm.step()
    assert llm.stats()["blocks_used"] > 0
    assert llm.abort(request.request_id)
    assert llm.stats()["blocks_used"] == 0
    assert not llm.has_work()
    assert not llm.abort(request.request_id)


def test_request_that_can_never_fit_fails_fast(model):
    llm = make_engine(model, num_blocks=4)                 # 64 tokens in the whole pool
    request = llm.add_request(list(range(10, 110)), GREEDY)
    assert request.error and "does not fit" in request.error
    assert not llm.has_work()
    # one that fits at first but outgrows the pool ends with a clear error, not a hang
    request = llm.add_request(list(range(10, 50)), SamplingParams(max_tokens=200, temperature=0))
    finals = []
    while llm.has_work():
        finals += [o for o in llm.step() if o.finished]
    assert finals and (finals[0].error or finals[0].finish_reasons == ["length"])
    assert llm.stats()["blocks_used"] == 0
    llm.runner.close()


def test_max_num_seqs_counts_the_samples_a_request_will_fork(model):
    runner = ModelRunner(model, EngineConfig(n_ctx=256, n_threads=1, n_batch=64, block_size=16, num_blocks=200))
    llm = LLMEngine(runner, EOT, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=4)
    for i in range(4):
        llm.add_request(list(range(10 + i, 30 + i)), params)
    peak = 0
    while llm.has_work():
        llm.step()
        peak = max(peak, sum(len(r.live_seqs) for r in llm.scheduler.running))
    assert peak == 4
    runner.close()


@pytest.mark.parametrize("num_blocks", range(12, 18))   # the n=4 request alone needs 12
def test_a_request_whose_samples_outgrow_the_pool_is_preempted_whole(model, num_blocks):
    # An earlier greedy request keeps its pages while a later n=4 request's
    # samples all need a fresh block in the same step. The pool holds only some
    # of them: the n=4 request must be preempted whole (no sample left in the
    # step without pages), and both requests still finish.
    llm = make_engine(model, num_blocks=num_blocks, budget=128)
    first = llm.add_request(list(range(10, 60)), SamplingParams(max_tokens=40, temperature=0))
    llm.step()
    sampled = llm.add_request(list(range(100, 115)),
                              SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=4))
    done = {}
    while llm.has_work():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    assert done[first.request_id].error is None
    assert done[sampled.request_id].error is None
    assert [len(s.output_ids) for s in sampled.seqs] == [20] * 4
    assert llm.stats()["blocks_used"] == 0
    llm.runner.close()


def test_an_aborted_step_is_a_compute_error_and_the_engine_goes_on(model):
    runner = ModelRunner(model, EngineConfig(n_ctx=256, n_threads=1, n_batch=64, block_size=16, num_blocks=32))
    seq = runner.add_sequence(list(range(10, 30)))
    runner.abort()
    with pytest.raises(ComputeError, match="aborted"):
        runner.step([(seq, 20)])
    assert seq.num_computed == 0                           # its KV counts as not written
    assert np.isfinite(runner.prefill(seq)).all()          # the request is consumed: the next step runs
    runner.free(seq)
    runner.close()


def test_a_preempted_request_that_can_no_longer_fit_ends_instead_of_waiting_forever(model):
    # found by bench/serving/soak.py: a preempted n=2 request is admitted again with a copy of
    # the prompt per sample, which a 6-block pool cannot hold even when empty
    llm = make_engine(model, num_blocks=6)
    prompt = list(range(10, 30))
    first = llm.add_request(prompt, SamplingParams(max_tokens=30, temperature=0))
    second = llm.add_request(prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=2, n=2))
    done = {}
    for _ in range(1000):   # a bound on steps: the engine must not spin without progress
        if not llm.has_work():
            break
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    assert not llm.has_work()
    assert set(done) == {first.request_id, second.request_id}
    assert all(o.error is None or "out of KV blocks" in o.error for o in done.values())
    assert llm.stats()["blocks_used"] == 0
    llm.runner.close()


def test_prefill_is_chunked_small_while_streams_decode(model):
    # the inter-token gap of running streams stays bounded when a long prompt arrives
    engine = ModelRunner(model, EngineConfig(n_ctx=256, n_threads=1, n_batch=256, block_size=16, num_blocks=200))
    llm = LLMEngine(engine, EOT, SchedulerConfig(max_num_batched_tokens=256, max_prefill_tokens_with_decodes=32))
    for i in range(3):
        llm.add_request(list(range(10 + i, 20 + i)), SamplingParams(max_tokens=30, temperature=0))
    llm.step()                                            # their prefill, alone: one step
    llm.add_request(list(range(50, 250)), SamplingParams(max_tokens=2, temperature=0))
    sizes = []
    for _ in range(5):                                    # the 200-token prompt arrives beside 3 streams
        before = llm.num_computed_tokens
        llm.step()
        sizes.append(llm.num_computed_tokens - before)
    assert all(n <= 3 + 32 for n in sizes)                # 3 decodes + at most 32 prompt tokens a step
    assert sum(sizes) > 5 * 3                             # and the prompt did advance
    while llm.has_work():
        llm.step()
    assert llm.stats()["blocks_used"] == 0
    engine.close()


class KnownCost(StepCostModel):
    """A step cost model fixed to a known machine: 10 ms a step, 10 ms a decode,
    1 ms a prefill token (the scheduler's policy under test, not the fit)."""

    def __init__(self):
        super().__init__(prior=(0.01, 0.01, 0.001), min_steps=0)

    def observe(self, decode_tokens, prefill_tokens, seconds):
        pass


def test_an_itl_budget_admits_only_the_streams_it_can_keep_and_starves_nobody(model):
    runner = ModelRunner(model, EngineConfig(n_ctx=256, n_threads=1, n_batch=256, block_size=16, num_blocks=400))
    llm = LLMEngine(runner, EOT, SchedulerConfig(max_num_batched_tokens=256, itl_budget=0.055))
    llm.scheduler.step_cost = KnownCost()   # predict(b decodes) = 0.01 + 0.01 b: 4 streams fit 55 ms
    requests = [llm.add_request(list(range(10 + i, 50 + i)), SamplingParams(max_tokens=8 + 3 * i, temperature=0))
                for i in range(9)]
    running, beside_decodes = [], []
    while llm.has_work():
        llm.step()
        running.append(llm.scheduler.num_running_seqs())
        decodes, prefill = llm.scheduler._last_shape
        if decodes and prefill:
            beside_decodes.append((decodes, prefill))
    assert max(running) == 4                    # the fifth would make every step 60 ms
    assert all(r.status.value == "finished" and r.error is None for r in requests)   # the queue drained
    assert all(len(r.seqs[0].output_ids) == 8 + 3 * i for i, r in enumerate(requests))
    # a 40-token prompt beside d decodes gets what the budget leaves (1 ms a token), at least 16
    assert beside_decodes
    for decodes, prefill in beside_decodes:
        assert prefill <= max(16, int(round((0.055 - 0.01 - 0.01 * decodes) / 0.001)))
    assert any(prefill < 40 for _, prefill in beside_decodes)   # the budget, not the prompt, cut the chunk
    runner.close()


def test_step_cost_model_learns_a_linear_machine():
    cost = StepCostModel()
    rng = np.random.default_rng(0)
    for _ in range(60):
        d, p = int(rng.integers(0, 40)), int(rng.integers(0, 200))
        cost.observe(d, p, 0.004 + 0.002 * decode_columns(d, p) + 0.0005 * p)   # padding costs like decodes
    assert cost.ready
    assert cost.coefficients == pytest.approx((0.004, 0.002, 0.0005), rel=0.05)
    assert cost.predict(10, 100) == pytest.approx(0.074, rel=0.02)
    assert cost.prefill_tokens_within(10, 0.074) == pytest.approx(100, abs=3)


def test_step_cost_counts_the_padded_columns_of_small_steps():
    # 5 to 7 decodes compute 8 columns (pp_matmul_columns): they cost what 8 do
    cost = StepCostModel(prior=(0.01, 0.005, 0.001), min_steps=0)
    assert cost.predict(5) == cost.predict(8) > cost.predict(4)
    assert cost.predict(2) < cost.predict(3) < cost.predict(4)
    assert cost.predict(20) - cost.predict(19) == pytest.approx(0.005)
    # 2 decodes and 3 prefill tokens compute 8 columns too: the padding counts as decode work
    assert cost.predict(2, 3) == pytest.approx(0.01 + 0.005 * 5 + 0.001 * 3)
    # ...so past the padding more prefill fits the same time: 2 + 18 columns cost 0.038 too
    assert cost.prefill_tokens_within(2, cost.predict(2, 3)) == 18


def test_an_itl_budget_must_be_seconds_auto_or_none(model):
    runner = ModelRunner(model, EngineConfig(n_ctx=64, n_threads=1, n_batch=64, block_size=16, num_blocks=8))
    for bad in (0, -1, "fast"):
        with pytest.raises(ValueError, match="itl_budget"):
            LLMEngine(runner, EOT, SchedulerConfig(itl_budget=bad))
    runner.close()


def test_step_logits_are_read_where_ggml_left_them_and_match_a_copied_step(model):
    from pyllama_paged._native import ffi, lib
    prompt = [2, 40, 41, 42, 43, 44, 45, 46, 47]
    in_place, copied = (ModelRunner(model, EngineConfig(n_ctx=64, n_threads=1, n_batch=64, block_size=16,
                                                        num_blocks=16))
                        for _ in range(2))
    seq = in_place.add_sequence(prompt)
    assert len(in_place.step([(seq, 4)])) == 0          # a non-final chunk: no logits row at all
    view = in_place.step([(seq, len(prompt) - 4)])
    assert view.shape == (1, in_place.n_vocab) and not view.flags.owndata
    other = copied.add_sequence(prompt)
    slots, tables = copied.kv.batch_arrays(other.handle, 0, len(prompt))
    out = np.empty((1, copied.n_vocab), dtype=np.float32)
    copied.forward(prompt, np.arange(len(prompt)), slots, np.zeros(len(prompt)), tables, [len(prompt) - 1], out=out)
    np.testing.assert_allclose(view, out, atol=1e-4)
    # a failed step leaves no rows behind to be mistaken for its own
    with pytest.raises(Exception):
        in_place.forward([in_place.n_vocab + 5], [9], [0], [0], np.zeros((1, 4), np.int32), [0])
    n_rows = ffi.new("int32_t *")
    assert lib.pp_context_step_logits(in_place._ctx, n_rows) == ffi.NULL
    assert n_rows[0] == 0
    in_place.close()
    copied.close()


def test_a_padded_step_matches_its_sequences_in_a_full_batch_of_four_columns(model):
    # 5 and 7 decodes run their matrix products over 8 columns (zero padding): the
    # padding must not reach the real rows, which match the same sequences among 8
    prompts = [[2] + [40 + i + j for j in range(6 + i)] for i in range(8)]
    config = EngineConfig(n_ctx=64, n_threads=1, n_batch=128, block_size=16, num_blocks=200)
    runners = [ModelRunner(model, config) for _ in range(2)]
    rows = []
    for runner, n in zip(runners, (5, 8)):
        seqs = [runner.add_sequence(p) for p in prompts]
        runner.step([(s, s.num_tokens) for s in seqs])
        for s in seqs:
            runner.append_tokens(s, [77])
        rows.append(runner.step([(s, 1) for s in seqs[:n]]).copy())
    np.testing.assert_allclose(rows[0], rows[1][:5], atol=1e-5)
    for runner in runners:
        runner.close()


def test_beam_width_and_logprobs_bounded_by_the_native_result(model):
    """The native result holds PP_SAMPLE_MAX_TOP entries; wider requests are refused
    before any sampling (a width of 17 once wrote 34 entries into 20)."""
    from pyllama_paged._native import ffi, lib
    from pyllama_paged.engine import MAX_LOGPROBS
    assert ffi.sizeof("pp_sample_result") >= lib.PP_SAMPLE_MAX_TOP * 8
    assert 2 * MAX_BEAM_WIDTH <= lib.PP_SAMPLE_MAX_TOP and MAX_LOGPROBS <= lib.PP_SAMPLE_MAX_TOP
    llm = make_engine(model)
    with pytest.raises(PagedError, match="beam_width"):
        llm.add_request([5, 6, 7], SamplingParams(beam_width=MAX_BEAM_WIDTH + 1))
    with pytest.raises(PagedError, match="logprobs"):
        llm.add_request([5, 6, 7], SamplingParams(logprobs=MAX_LOGPROBS + 1))
    assert llm.stats()["blocks_used"] == 0
    llm.runner.close()


@pytest.mark.parametrize("bad", ["all_minus_inf", "raises"])
def test_a_bad_row_fails_its_own_request_only(model, bad):
    """A row that allows no finite logit, or whose logits processor raises, ends its
    request with an error; the request sampled beside it in the same step goes on."""
    def processor(ids, row):
        if bad == "raises":
            raise ValueError("user code failed")
        return np.full_like(row, -np.inf)

    llm = make_engine(model)
    good = llm.add_request(list(range(10, 30)), SamplingParams(max_tokens=6, temperature=0))
    broken = llm.add_request(list(range(40, 60)), SamplingParams(max_tokens=6, temperature=0,
                                                                 logits_processor=processor))
    results = {}
    while llm.has_work():
        for out in llm.step():
            got = results.setdefault(out.request_id, {"tokens": 0, "error": None, "finished": False})
            got["tokens"] += len(out.events)
            got["error"] = got["error"] or out.error
            got["finished"] = got["finished"] or out.finished
    assert results[broken.request_id]["finished"] and results[broken.request_id]["tokens"] == 0
    assert ("user code failed" if bad == "raises" else "no token can be sampled") in results[broken.request_id]["error"]
    assert results[good.request_id] == {"tokens": 6, "error": None, "finished": True}
    assert llm.stats()["blocks_used"] == 0
    llm.runner.close()
