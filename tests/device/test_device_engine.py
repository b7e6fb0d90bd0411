"""The engine on a GGML GPU device, against the float64 reference and the CPU engine.

Skipped where GGML lists no GPU (the default install). CI runs them on Mesa's software
Vulkan device (lavapipe) with a GGML built for Vulkan (.ci/run); each check runs in a
child process (testing/device_checks.py), so a crash inside the driver fails one check
by name. The checks print the device they ran on."""

import pytest

from pyllama_paged.engine import list_devices
from pyllama_paged.testing.device_checks import ARCH_WEIGHTS, run_check

pytestmark = pytest.mark.skipif(not any(d.is_gpu for d in list_devices()),
                                reason="GGML lists no GPU (build libggml-python for Vulkan or CUDA: see docs/builds-and-gpus.md)")


@pytest.mark.parametrize("arch", sorted(ARCH_WEIGHTS))
def test_tiny_models_match_the_reference_on_the_device(arch):
    """All layers on the device (pages f16 and q8_0, the slab baseline) and a split."""
    answer = run_check("reference", arch)
    for name, r in answer["result"].items():
        assert r["error"] < r["tolerance"], f"{arch} {name}: relative error {r['error']:.4f}"
        assert r["argmax_agreement"] >= 0.85, f"{arch} {name}"   # random tiny models have near-ties
    placement = answer["result"]
    assert set(placement["all_f16"]["placement"][:-1]) == {answer["device"]}
    split = placement["last_layer"]["placement"]
    assert split[-2] == answer["device"] and set(split[:-2]) == {"CPU"} and split[-1] == "CPU"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_mixed_steps_match_the_reference_with_one_attention_call_per_group(arch):
    """Decode runs and prefill chunks of several lengths in one step (sliding windows too):
    every row against the reference; a decode step's graph is the same at 1 and 6 sequences."""
    r = run_check("mixed", arch)["result"]
    assert r["rows"] == 13 and max(r["errors"]) < r["tolerance"], r["errors"]
    graphs = r["decode_graphs"]
    assert graphs["1"] == graphs["6"], graphs


def test_forks_copy_on_write_on_the_device():
    r = run_check("forks")["result"]
    assert max(r["errors"]) < r["tolerance"], r["errors"]


def test_window_pages_given_back_on_the_device():
    r = run_check("window")["result"]
    assert r["error"] < r["tolerance"], r["error"]
    held = r["blocks_held_by_group"]
    assert held[0] == -(-150 // 16)          # the global group keeps every page
    assert max(held[1:]) <= 3                # window 16: two pages and the one being written


def test_scheduler_preemption_samples_and_beams_on_the_device():
    r = run_check("engine")["result"]
    for name in ("batched", "swap", "recompute"):
        assert r[name]["agree"] and r[name]["blocks_used_after"] == 0, (name, r[name])
    assert r["swap"]["preemptions"] > 0 and r["recompute"]["preemptions"] > 0
    assert r["samples"]["n"] == 3 and r["samples"]["lengths"] == [30, 30, 30]
    assert r["samples"]["beams"] >= 1 and r["samples"]["blocks_used_after"] == 0


def test_default_model_answers_like_the_cpu_on_the_device():
    answer = run_check("default_model")
    r = answer["result"]
    assert r["block_round_trip"] and r["kv_device_layers"] == 18
    assert set(r["placement"][:-1]) == {answer["device"]}
    # near-ties allowed (checked inside); most answers are the same text
    assert sum(a["same"] for a in r["answers"]) >= 2, r["answers"]


def test_a_kv_pool_beyond_the_device_is_a_clear_error():
    r = run_check("limits")["result"]
    assert r["refused"] and ("cannot hold a KV pool" in r["refused"] or "cannot allocate KV pools" in r["refused"])
    assert r["then_runs"]


def test_server_with_gpu_layers_answers_like_the_cpu():
    r = run_check("server")["result"]
    assert [a["agree"] for a in r["answers"]] == [True, True]   # near-ties allowed (checked in the child)
    assert r["size_vram"] > 0                                    # /api/ps counts what the GPU holds


def test_info_reports_a_partial_split():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "pyllama_paged.cli", "info", "--gpu-layers", "5"],
                       capture_output=True, text=True, timeout=600, cwd="/")
    assert p.returncode == 0, p.stderr[-2000:]
    device = next(d.name for d in list_devices() if d.is_gpu)
    print(f"info ran on {device}")
    assert "layers 0-12: CPU" in p.stdout and f"layers 13-17: {device}" in p.stdout
    assert "output head: CPU" in p.stdout and f"weights on {device}:" in p.stdout
