"""GGML 0.20.2's CUDA-graph replay rule (pyllama_paged/testing/cuda_graph_replay.py) on the step
graphs our context really builds on the device path (attention="gather"): steady decode replays
from its third step, and a changed shape, batch or address is caught at the node it changed."""

import numpy as np
import pytest

from pyllama_paged.engine import EngineConfig, Model
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.errors import PagedError
from pyllama_paged.testing.cuda_graph_replay import (CAPTURE, EAGER, REPLAY, CudaGraphReplay, first_difference,
                                                     first_shape_change, read_step_graph)
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("replay") / "llama.gguf", "llama", weight_type="q8_0")
    with Model(path, pack_panels=False, repack_weights=False) as m:
        yield m


def _runner(model, attention="gather", n_threads=1):
    runner = ModelRunner(model, EngineConfig(paged=True, n_ctx=256, n_seq_max=8, n_threads=n_threads, n_batch=256,
                                             block_size=16, attention=attention))
    runner.set_argmax("always")
    return runner


def _prefilled(runner, n_seqs, prompt_len, seed=0):
    rng = np.random.default_rng(seed)
    seqs = [runner.add_sequence([int(t) for t in rng.integers(4, 200, prompt_len)]) for _ in range(n_seqs)]
    for s in seqs:
        runner.prefill(s)
    return seqs


def _decode(runner, seqs, sims):
    for s in seqs:
        runner.append_tokens(s, [7])
    runner.step([(s, 1) for s in seqs])
    graph = read_step_graph(runner)
    return [sim.observe(graph) for sim in sims], graph


def test_steady_decode_replays_from_its_third_step_by_uid_and_by_properties(model):
    runner = _runner(model)
    try:
        seqs = _prefilled(runner, 6, 20)
        by_uid, by_props = CudaGraphReplay(), CudaGraphReplay(uid_shortcut=False)
        kinds = [[o.kind for o in _decode(runner, seqs, [by_uid, by_props])[0]] for _ in range(12)]   # keys 21..32
    finally:
        runner.close()
    want = [EAGER, CAPTURE] + [REPLAY] * 10
    # the graph kept for the next step is unchanged node for node, not only by its uid
    assert [k[0] for k in kinds] == want and [k[1] for k in kinds] == want


def test_a_key_bucket_filling_is_caught_where_the_gather_grows(model):
    runner = _runner(model)
    try:
        seqs = _prefilled(runner, 3, 60)
        sim = CudaGraphReplay(uid_shortcut=False)
        seen = [_decode(runner, seqs, [sim])[0][0] for _ in range(8)]   # keys 61..68: the 64-key bucket fills
    finally:
        runner.close()
    assert [o.kind for o in seen] == [EAGER, CAPTURE, REPLAY, REPLAY, EAGER, CAPTURE, REPLAY, REPLAY]
    change = seen[4]
    # GGML compares in node order: the first node that moved is reported, then the first
    # whose shape changed: the gathered keys, 64 -> 128 per sequence for 3 sequences
    assert change.changed.startswith("node ")
    assert "GET_ROWS: ne [" in change.shape and ", 192, 1, 1] -> [" in change.shape and ", 384, 1, 1]" in change.shape


def test_a_sequence_leaving_the_batch_changes_the_first_node(model):
    runner = _runner(model)
    try:
        seqs = _prefilled(runner, 4, 10)
        sim = CudaGraphReplay()
        for _ in range(3):
            _decode(runner, seqs, [sim])
        (leaving,), _ = _decode(runner, seqs[:3], [sim])
        (again,), _ = _decode(runner, seqs[:3], [sim])
    finally:
        runner.close()
    assert leaving.kind == EAGER and again.kind == CAPTURE
    # the token-embedding lookup reads one row fewer
    assert leaving.changed.startswith("node 0 ") and "ne [" in leaving.changed and ", 4, 1, 1] -> [" in leaving.changed


def test_two_graphs_of_one_shape_differ_only_in_addresses(model):
    graphs = []
    for _ in range(2):
        runner = _runner(model)
        try:
            seqs = _prefilled(runner, 2, 12)
            graphs.append(_decode(runner, seqs, [])[1])
        finally:
            runner.close()
    a, b = graphs
    assert len(a.hashes) == len(b.hashes)
    assert a.count("FLASH_ATTN_EXT") == model.config.n_layer and a.count("ARGMAX") == 1
    # another context's pools and buffers: GGML would not replay, though no shape changed
    assert first_difference(a, b) is not None and first_shape_change(a, b) is None


@pytest.mark.parametrize("attention, rebuilds", [("gather", 0), ("kernel", 1)])
def test_another_thread_count_rebuilds_only_a_graph_that_reads_it(model, attention, rebuilds):
    runner = _runner(model, attention)
    try:
        seqs = _prefilled(runner, 2, 12)
        sim = CudaGraphReplay()
        for _ in range(3):
            _decode(runner, seqs, [sim])
        builds = runner.step_stats()["builds"]
        runner.set_threads(2)
        (after,), _ = _decode(runner, seqs, [sim])
        rebuilt = runner.step_stats()["builds"] - builds
    finally:
        runner.close()
    assert rebuilt == rebuilds
    if attention == "gather":   # the device path: the thread policy never costs a replay
        assert after.kind == REPLAY


def test_a_context_without_a_graph_has_no_nodes_to_read(model):
    runner = _runner(model)
    try:
        with pytest.raises(PagedError, match="no step graph"):
            read_step_graph(runner)
    finally:
        runner.close()
