"""bench/common/gpu_model.py: the kernels it counts for our engine are those of our real decode
graph after GGML's CUDA fusions, its table covers every workload device_bench.py runs on every
device it predicts, and a measured row finds its prediction."""

import numpy as np
import pytest

from pyllama_paged.engine import EngineConfig, Model
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.testing.cuda_graph_replay import read_step_graph
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model


@pytest.fixture(scope="module")
def gpu_model(bench):
    return bench("bench.common.gpu_model")


def _decode_graph(path, n_seqs):
    with Model(path, pack_panels=False, repack_weights=False) as model:
        runner = ModelRunner(model, EngineConfig(paged=True, n_ctx=128, n_seq_max=8, n_threads=1, n_batch=128,
                                                 block_size=16, attention="gather"))
        try:
            runner.set_argmax("always")   # the head on a device adds its argmax
            seqs = [runner.add_sequence([5 + i, 6, 7, 8]) for i in range(n_seqs)]
            for s in seqs:
                runner.prefill(s)
                runner.append_tokens(s, [9])
            runner.step([(s, 1) for s in seqs])
            return read_step_graph(runner)
        finally:
            runner.close()


def test_our_kernel_constants_are_our_real_graphs(gpu_model, tmp_path):
    counts = {}
    for n_layer in (2, 3):
        path = write_tiny_model(tmp_path / f"llama{n_layer}.gguf", "llama", weight_type="q8_0", n_layer=n_layer)
        # from 2 sequences: the CPU pads a lone column of some weight types, a device never does
        counts[n_layer] = {n: gpu_model.graph_kernels(_decode_graph(path, n)) for n in (2, 4)}
        assert counts[n_layer][2] == counts[n_layer][4]   # the same graph at any number of sequences
    per_layer = counts[3][2] - counts[2][2]
    assert per_layer == gpu_model.OUR_KERNELS_PER_LAYER
    assert counts[2][2] - 2 * per_layer == gpu_model.OUR_KERNELS_FIXED


def test_fusions_need_consecutive_nodes(gpu_model):
    k = gpu_model.cuda_kernels
    assert k(["RMS_NORM", "MUL", "MUL_MAT"], [1, 1, 1]) == 2
    assert k(["ROPE", "VIEW", "SET_ROWS"], [1, 1, 1]) == 1
    assert k(["ROPE", "RESHAPE", "VIEW", "SET_ROWS"], [1, 1, 1, 1]) == 2     # our K today: no fusion
    assert k(["MUL_MAT", "MUL_MAT", "SWIGLU"], [4, 4, 4]) == 1
    assert k(["MUL_MAT", "MUL_MAT", "SWIGLU"], [16, 16, 16]) == 3            # past MMVQ's columns
    assert k(["FLASH_ATTN_EXT"], [1]) == 3 and k(["FLASH_ATTN_EXT"], [1], f32_kv=False) == 1


def test_the_table_covers_every_workload_and_finds_a_measured_row(gpu_model, bench):
    device_bench = bench("bench.device_bench")
    rows = gpu_model.predictions("H200")
    assert {r["model"] for r in rows} == set(device_bench.DEFAULT_MODELS.split(","))
    measured = {"batched t/s", "single-stream tg t/s", "single-stream pp t/s", "chat tokens/s",
                "step ms (lower is better)"}
    assert {r["workload"] for r in rows} == measured
    assert all(np.isfinite(r["ours"]) and r["ours"] > 0 and r["llama.cpp"] > 0 for r in rows)
    # our KV moves 7x llama.cpp's bytes: the gap grows with the sequences
    steps = {r["setting"]: r["ours / llama.cpp"] for r in rows
             if r["model"] == "llama3.2-3b" and r["workload"].startswith("step")}
    assert steps["npl 1"] < steps["npl 64"]
    # named as the workloads' own tables name them (device_bench.summary_rows)
    got = gpu_model.prediction_for(rows, "NVIDIA H200", "llama3.2-1b", "chat tokens/s",
                                   "t=0.7, llama-server -np 32 -kvu")
    assert got == next(r["ours"] for r in rows if r["workload"] == "chat tokens/s" and r["model"] == "llama3.2-1b")
    assert gpu_model.prediction_for(rows, "NVIDIA H200", "llama3.2-3b", "batched t/s", "npl 16") is not None
    assert gpu_model.prediction_for(rows, "NVIDIA H200", "llama3.2-3b", "single-stream tg t/s", "tg128") is not None
    assert gpu_model.prediction_for(rows, "NVIDIA A100", "llama3.2-1b", "batched t/s", "npl 1") is None
