"""GGML's devices as the package sees them, the n_gpu_layers rule, and asking for a GPU
where GGML lists none (the default install): a clear error, the model left usable."""

import os
import subprocess
import sys

import pytest

from pyllama_paged._native import ffi, lib
from pyllama_paged.engine import Model, gpu_device, list_devices
from pyllama_paged.engine.worker.devices import LayerSplit
from pyllama_paged.errors import PagedError

NO_GPU = not any(d.is_gpu for d in list_devices())
CLI = [sys.executable, "-m", "pyllama_paged.cli"]


def test_the_cpu_is_listed_with_its_memory():
    cpu = [d for d in list_devices() if d.type == "cpu"]
    assert len(cpu) == 1 and cpu[0].name == "CPU" and cpu[0].memory_total > 0
    with pytest.raises(Exception, match="does not exist"):
        from pyllama_paged._native import check
        check(lib.pp_device_get(lib.pp_device_count(), ffi.new("pp_device_info *")), "device")


@pytest.mark.parametrize("asked,layers,output", [(-1, 18, True), (0, 0, False), (5, 5, False), (18, 18, False),
                                                 (19, 18, True), (99, 18, True)])
def test_layer_split_follows_llama_cpp(asked, layers, output):
    split = LayerSplit.for_request(asked, 18)
    assert (split.n_device_layers, split.output) == (layers, output)
    assert split.first_device_layer == 18 - layers


def test_negative_layer_counts_other_than_all_are_refused():
    with pytest.raises(PagedError, match="-1 \\(all\\) or >= 0"):
        LayerSplit.for_request(-2, 18)


def test_offloading_to_the_cpu_or_an_unknown_device_is_refused_and_changes_nothing():
    model = Model(pack_panels=False, repack_weights=False)
    try:
        cpu = next(d.index for d in list_devices() if d.type == "cpu")
        assert lib.pp_model_offload(model.native, cpu, 4, 0) == lib.PP_ERR_INVALID
        assert b"is the CPU" in ffi.string(lib.pp_last_error())
        assert lib.pp_model_offload(model.native, 99, 4, 0) == lib.PP_ERR_INVALID
        assert b"does not exist" in ffi.string(lib.pp_last_error())
        assert all(lib.pp_model_layer_device(model.native, il) == -1 for il in range(19))
        assert lib.pp_model_device_bytes(model.native) == 0
        assert model.layer_placement() == ["CPU"] * 19
    finally:
        model.close()


@pytest.mark.skipif(not NO_GPU, reason="this GGML lists a GPU")
def test_asking_for_a_gpu_without_one_is_a_clear_error():
    with pytest.raises(PagedError, match="GGML lists none"):
        gpu_device(0)
    with pytest.raises(PagedError, match="GGML lists none"):
        Model(n_gpu_layers=-1)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for command in (["run", "--gpu-layers", "4", "hi"], ["serve", "--gpu-layers", "99", "--port", "1"]):
        p = subprocess.run(CLI + command, capture_output=True, text=True, timeout=300, env=env, cwd="/")
        assert p.returncode != 0 and "GGML lists none" in p.stderr, (command, p.stderr[-2000:])


@pytest.mark.skipif(not NO_GPU, reason="this GGML lists a GPU")
def test_llama_warns_and_runs_on_the_cpu_like_llama_cpp():
    from pyllama_paged import Llama

    with pytest.warns(UserWarning, match="n_gpu_layers=-1 asks for a GPU"):
        llm = Llama(n_ctx=256, n_threads=2, n_gpu_layers=-1)
    try:
        assert llm._model.device is None and "red" in llm("The three primary colors are", max_tokens=8,
                                                          temperature=0)["choices"][0]["text"]
    finally:
        llm.close()


def test_info_lists_devices_and_where_layers_run():
    p = subprocess.run(CLI + ["info"], capture_output=True, text=True, timeout=300, cwd="/")
    assert p.returncode == 0, p.stderr
    assert "devices (GGML):" in p.stdout and ": CPU (cpu)" in p.stdout
    assert "layers 0-17: CPU" in p.stdout and "output head: CPU" in p.stdout
