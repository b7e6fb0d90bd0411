"""A GPU loan walked without a GPU: bench/device_bench.py --dry-run goes through every step but the
GPU's (carry, models, the workloads' command lines, predictions, packing) and says what is missing;
a carry is checked for what the run needs; the results come back as one file, and never as more
files than a loan returns. bench/gpu_carry.sh's packing is checked by running it (--check) only by
hand: it downloads wheels and builds our library (minutes)."""

import os
import shutil
import tarfile
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def device_bench(bench):
    return bench("bench.device_bench")


@pytest.fixture(scope="module")
def loan(bench):
    return bench("bench.common.loan")


def test_a_dry_run_walks_every_step_and_names_the_missing_carry(device_bench, tmp_path, capsys):
    back = tmp_path / "back"
    code = device_bench.main(["--dry-run", "--carry", str(tmp_path / "none.tar.xz"), "--out", str(tmp_path / "out"),
                              "--tar", str(back), "--llama-cpp-bin", "/carried/bin"])
    out = capsys.readouterr().out
    assert code == 1 and "no " + str(tmp_path / "none.tar.xz") in out and "bench/gpu_carry.sh" in out
    # every workload on both files, with the carried tools, and a prediction for each measured figure
    for workload in ("batched", "single", "chat", "step"):
        for model in ("llama3.2-1b", "llama3.2-3b"):
            assert f"4. {model} {workload}: " in out
    assert "--llama-batched-bench /carried/bin/llama-batched-bench" in out
    for figure in ("batched t/s", "single-stream tg t/s", "chat tokens/s", "step ms"):
        assert figure in out
    packed = back / "device_bench.tar.xz"
    assert [p.name for p in back.iterdir()] == [packed.name]
    with tarfile.open(packed) as tar:
        names = tar.getnames()
    assert any(n.endswith("device_bench.md") for n in names) and any(n.endswith("device_bench.json") for n in names)


def _site_from_this_install(root: Path, with_cuda: bool, loan=None) -> None:
    """A carry's layout from the installed package, GGML and (given loan) the modules a carry
    brings (a CPU GGML: no CUDA library unless asked for by name, which the check looks for)."""
    import importlib

    import libggml
    import pyllama_paged
    site = root / "site"
    site.mkdir(parents=True)
    shutil.copytree(Path(pyllama_paged.__file__).parent, site / "pyllama_paged")
    shutil.copytree(Path(libggml.__file__).parent, site / "libggml")
    for module in loan.CARRIED_MODULES if loan else ():
        shutil.copytree(Path(importlib.import_module(module).__file__).parent, site / module)
    if with_cuda:   # the wheel's libraries are in lib64, a build from the sdist's in lib
        libs = next(site / "libggml" / d for d in ("lib64", "lib") if (site / "libggml" / d).is_dir())
        shutil.copy(libs / "libggml.so.0", libs / "libggml-cuda.so")
    (root / "llama.cpp" / "bin").mkdir(parents=True)


def test_a_carry_without_cuda_or_llama_cpp_tools_is_reported(loan, tmp_path):
    _site_from_this_install(tmp_path, with_cuda=False)
    problems = loan.carry_problems(tmp_path)
    assert any("libggml-cuda.so" in p for p in problems)
    assert sum("llama.cpp/bin/" in p for p in problems) == len(loan.LLAMA_CPP_TOOLS)
    assert not any("libpyllama_paged.so" in p for p in problems)


def test_a_complete_carry_is_unpacked_and_run_on(loan, tmp_path):
    stage = tmp_path / "stage"
    _site_from_this_install(stage, with_cuda=True, loan=loan)
    for tool in loan.LLAMA_CPP_TOOLS:
        path = stage / "llama.cpp" / "bin" / tool
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    carry = tmp_path / "carry.tar.xz"
    with tarfile.open(carry, "w:xz") as tar:
        tar.add(stage, arcname=".")
    root = loan.unpack_carry(carry, tmp_path / "unpacked")
    problems = loan.carry_problems(root)
    assert problems == []
    env = loan.carry_env(root, {"PYTHONPATH": "/x", "LD_LIBRARY_PATH": "/y"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(root / "site"), "/x"]
    assert env["LD_LIBRARY_PATH"].split(":") == [str(loan.ggml_lib_dir(root / "site")), "/y"]
    assert (loan.ggml_lib_dir(root / "site") / "libggml.so.0").exists()


def test_results_come_back_as_one_file_and_never_as_more_than_a_loan_returns(loan, tmp_path):
    out = tmp_path / "results" / "nvidia-h100"
    out.mkdir(parents=True)
    for i in range(20):
        (out / f"r{i}.json").write_text("{}")
    packed = loan.tar_results(out, tmp_path / "back")
    assert packed.name == "device_bench.tar.xz" and len(list((tmp_path / "back").iterdir())) == 1
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    for i in range(loan.MAX_FILES_BACK):
        (crowded / f"other{i}").write_text("x")
    with pytest.raises(RuntimeError, match="at most 8"):
        loan.tar_results(out, crowded)


def test_without_the_carry_or_a_bin_folder_llama_cpp_is_never_built(device_bench, monkeypatch):
    monkeypatch.delenv("PYLLAMA_DEVICE_BENCH_CARRY", raising=False)
    args = device_bench.parser().parse_args([])
    assert device_bench.llama_cpp_bin(args) is None
    args = device_bench.parser().parse_args(["--llama-cpp-bin", "/b"])
    assert device_bench.llama_cpp_bin(args) == Path("/b")
