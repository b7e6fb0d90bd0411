"""bench/device_bench.py without a GPU: it refuses (exit 2, nothing written); its plan runs each
workload's script with every layer on the GPU against llama.cpp's tools; a spent budget skips
what is left; and (slow, with llama.cpp's CPU tools) the very command lines it builds, run on
the CPU with --gpu-layers 0 on a tiny model, give a summary row for every workload."""

import os
import sys
import time
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
BENCH = CHECKOUT / "bench"


@pytest.fixture(scope="module")
def device_bench(bench):
    """The script as a module of the bench package, as `python -m bench.device_bench` runs it."""
    return bench("bench.device_bench")


def test_refuses_without_an_nvidia_gpu_and_writes_nothing(device_bench, tmp_path, capsys):
    if device_bench.nvidia_gpus():
        pytest.skip("an NVIDIA GPU is here: the benchmark would run")
    assert device_bench.main(["--out", str(tmp_path / "out")]) == device_bench.REFUSED == 2
    assert not (tmp_path / "out").exists()
    assert "no NVIDIA GPU" in capsys.readouterr().err


def test_default_plan_runs_every_workload_on_both_llama_files_on_the_gpu(device_bench, tmp_path):
    args = device_bench.parser().parse_args([])
    assert args.models == "llama3.2-1b,llama3.2-3b"
    resolved = [device_bench.resolve_model(name) for name in args.models.split(",")]
    assert [(label, Path(path).name, preset) for label, path, preset in resolved] == [
        ("llama3.2-1b", "llama3.2-synthetic-1b-q4_k_m.gguf", "llama3.2-1b"),
        ("llama3.2-3b", "llama3.2-synthetic-3b-q4_k_m.gguf", "llama3.2-3b")]
    assert all(Path(path).parent == BENCH / ".models" for _, path, _ in resolved)
    assert device_bench.resolve_model("synthetic")[1:] == (
        str(BENCH / ".models" / "gemma3-synthetic-1.6b-q4_k_m.gguf"), "gemma3-1.6b")
    assert device_bench.resolve_model("/x/my-model.gguf") == ("my-model", "/x/my-model.gguf", None)

    cuda_bin = Path("/cuda/bin")
    plan = device_bench.workload_plan(args, {label: path for label, path, _ in resolved}, cuda_bin, tmp_path)
    # each workload on both models before the next
    assert [(p["workload"], p["model"]) for p in plan] == [
        (w, m) for w in ("batched", "single", "chat", "step") for m in ("llama3.2-1b", "llama3.2-3b")]
    for p in plan:
        cmd = p["cmd"]
        assert cmd[:3] == [sys.executable, "-m", device_bench.SCRIPTS[p["workload"]]]
        assert cmd[cmd.index("--gpu-layers") + 1] == "-1"
        assert cmd[cmd.index("--out") + 1] == str(tmp_path / p["model"])
        assert "--sides" not in cmd   # llama.cpp's side runs
    cmds = {p["workload"]: " ".join(p["cmd"][3:]) for p in plan if p["model"] == "llama3.2-1b"}
    assert "--npl 1 16 64 --llama-batched-bench /cuda/bin/llama-batched-bench" in cmds["batched"]
    assert "--npp 128 --ntg 128" in cmds["batched"]
    assert "--llama-bench /cuda/bin/llama-bench" in cmds["single"] and "--repeats 3" in cmds["single"]
    assert "--llama-server /cuda/bin/llama-server" in cmds["chat"] and "--requests 32" in cmds["chat"]
    assert "--paths gather --llama-batched-bench /cuda/bin/llama-batched-bench" in cmds["step"]
    assert "--npl 1 16 64" in cmds["step"]


def test_ours_only_runs_our_side_alone_and_leaves_out_the_single_stream(device_bench, tmp_path):
    args = device_bench.parser().parse_args(["--ours-only"])
    plan = device_bench.workload_plan(args, {"m": "/x/m.gguf"}, None, tmp_path)
    by_workload = {p["workload"]: p["cmd"] for p in plan}
    assert by_workload["single"] is None   # single_stream.py always runs llama-bench
    for workload in ("batched", "chat", "step"):
        cmd = by_workload[workload]
        assert cmd[cmd.index("--sides") + 1] == "ours"
        assert not any("llama-" in part for part in cmd)
    status = device_bench.run_plan([p for p in plan if p["cmd"] is None], budget_s=1e9, started=time.monotonic())
    assert status["m"]["single"]["result"] == "skipped"


def test_a_spent_budget_skips_every_workload_left_and_the_summary_says_so(device_bench, tmp_path):
    args = device_bench.parser().parse_args(["--models", "/x/a.gguf"])
    plan = device_bench.workload_plan(args, {"a": "/x/a.gguf"}, Path("/cuda/bin"), tmp_path)
    status = device_bench.run_plan(plan, budget_s=0, started=time.monotonic())
    assert {w: e["result"] for w, e in status["a"].items()} == dict.fromkeys(device_bench.WORKLOADS, "skipped")
    assert not any(tmp_path.iterdir())   # nothing ran
    rows = device_bench.summary_rows(tmp_path, status)
    assert [(r["workload"], r["setting"]) for r in rows] == [(w, "skipped") for w in device_bench.WORKLOADS]
    assert all("budget of 0 s was spent" in r["error"] for r in rows)


def test_a_workload_past_its_time_is_stopped_with_its_children(device_bench, tmp_path):
    child = tmp_path / "child.pid"
    # a stand-in for a workload whose server hangs: a shell that starts a sleeping child
    cmd = ["sh", "-c", f"sleep 60 & echo $! > {child}; wait"]
    t0 = time.monotonic()
    assert device_bench.run_command(cmd, timeout=1) is None
    assert time.monotonic() - t0 < 30
    stat = Path(f"/proc/{int(child.read_text())}/stat")

    def running() -> bool:
        # gone, or a zombie its new parent has not reaped yet: either way no longer running
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10   # a signal is delivered, not waited for
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running()


def llama_cpp_bin() -> Path:
    """llama.cpp's CPU tools (bench/build_llama_cpp.sh), or skip."""
    bin_dir = Path(os.environ.get("LLAMA_CPP_BIN", BENCH / ".llama.cpp" / "build" / "bin"))
    if not all((bin_dir / t).is_file() for t in ("llama-batched-bench", "llama-bench", "llama-server")):
        pytest.skip("llama.cpp's tools are not built (bench/build_llama_cpp.sh builds them)")
    return bin_dir


@pytest.mark.slow
def test_each_workload_command_runs_on_the_cpu_and_the_summary_reads_it(device_bench, tmp_path):
    from pyllama_paged.testing import synthetic_gguf, synthetic_presets

    bin_dir = llama_cpp_bin()
    model = tmp_path / "llama-small.gguf"
    synthetic_gguf.write(model, synthetic_presets.shrink(synthetic_presets.get("llama3.2-1b")))
    # the GPU run's command lines at tiny sizes; npp + ntg whole blocks of 16 for step_overhead's pool
    args = device_bench.parser().parse_args([
        "--models", str(model), "--threads", "1", "--npl", "1,2", "--batched-args", "--npp 16 --ntg 8",
        "--single-args", "--npp 16 --ntg 8 --repeats 1", "--step-args", "--npl 1 2 --npp 16 --ntg 16 --repeats 1",
        "--chat-args", "--requests 4 --rate 8 --output-mean 16 --ctx 1024 --peers np2"])
    label, path, preset = device_bench.resolve_model(args.models)
    assert (label, preset) == ("llama-small", None)
    out = tmp_path / "out"
    plan = device_bench.workload_plan(args, {label: path}, bin_dir, out, gpu_layers=0)
    status = device_bench.run_plan(plan, budget_s=1200, started=time.monotonic())
    assert {w: e["result"] for w, e in status[label].items()} == dict.fromkeys(device_bench.WORKLOADS, "ok")

    rows = device_bench.summary_rows(out, status)
    settings = {(r["workload"], r["setting"]) for r in rows}
    assert {("batched t/s", "npl 1"), ("batched t/s", "npl 2"), ("single-stream tg t/s", "tg8"),
            ("single-stream pp t/s", "pp16"), ("chat tokens/s", "t=0.7, llama-server -np 2"),
            ("step ms (lower is better)", "npl 1"), ("step ms (lower is better)", "npl 2")} <= settings
    for r in rows:
        assert r["ours"] > 0 and r["llama.cpp"] > 0
        assert r["ours / llama.cpp"] == pytest.approx(r["ours"] / r["llama.cpp"], rel=0.01)
    steps = [r for r in rows if r["workload"].startswith("step")]
    assert all(r["nodes"] > 0 and r["inputs"] > 0 and r["ours via LLMEngine"] > 0 for r in steps)
    assert [r["workload"] for r in device_bench.run_times(status)] == list(device_bench.WORKLOADS)
