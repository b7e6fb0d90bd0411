"""The GPU benchmark: our engine on CUDA against llama.cpp built with CUDA, side by side in
one run, by default on the synthetic Llama 3.2 1B and 3B Q4_K_M files (issue 38).

Without an NVIDIA GPU (nvidia-smi absent or listing none) it refuses: a message and exit
code 2, nothing written. --functional-check instead runs, on any GPU GGML lists (CUDA, or
Vulkan, the software device lavapipe included), a short check of the engine on that device
against the CPU and prints no timings: every layer and the output head placed on the device,
and four greedy answers computed together in one batch there agreeing with the CPU's
(up to near-ties, pyllama_paged.testing.agreement).

The benchmark runs the CPU benchmarks' own scripts with every layer on the GPU (--gpu-layers -1
on our side, -ngl on llama.cpp's, llama.cpp with flash attention on, the same KV bytes), each
workload on every model before the next workload:
- batched: bench/engine/batched.py, llama-batched-bench's workload (npl sequences of npp prompt
  + ntg generated tokens) on LLMEngine and on llama-batched-bench; npl 1,16,64, npp = ntg = 128;
- single: bench/engine/single_stream.py, one stream's decode (tg128) and prefill (pp512) on
  ModelRunner and on llama-bench, best of 3 rounds;
- chat: bench/serving/chat_trace.py, a multi-user streaming chat trace (32 requests at 16/s)
  through `pyllama-paged serve` and llama-server (-np 8, -np 32 -kvu) in the same KV bytes;
- step: bench/engine/step_overhead.py, ms per decode step at 1, 16 and 64 sequences on the
  device path (--paths gather: a device always takes it) against llama-batched-bench, with the
  step graph's node and input counts.
--models takes 'default' (the embedded model), 'synthetic' (the 1.6B Gemma 3 file), a preset
of pyllama_paged/testing/synthetic_presets.py (written to bench/.models/<its file name> on
first use) or a GGUF path. Each workload writes its JSON, markdown and PNG into
bench/results/device/<gpu>/<model>/; this script adds device_bench.{json,md,png} in
bench/results/device/<gpu>/: ours / llama.cpp per workload, and each workload's run time.

The defaults fit the whole run (2 models x 4 workloads, the models written first) in about 8
minutes on an H100 with 16 cores: once --budget-s (counted from the start) is spent, the
workloads left are skipped and reported so, and a workload still running then is stopped a
minute later (GRACE_S), so one call always comes back with what it measured.

Nothing is built or downloaded on the GPU machine (it reaches no network, and 15 minutes are the
whole loan): bench/gpu_carry.sh builds here, once, one file, bench/.carry/carry.tar.xz (the CUDA
GGML for sm_90, our library against it, the Python 3.12 wheels the machine lacks, llama.cpp
b10488's tools on the same GGML); this script unpacks it and runs itself again on it. The loan's
one call, with the carry beside the tracked tree:

    python -m bench.device_bench --tar $OUT      # results packed into $OUT/device_bench.tar.xz

Each measured row stands beside our prediction (bench/common/gpu_model.py). --dry-run walks every
step but the GPU's on any machine: the carry unpacked and checked, the models, each workload's
command line, the predictions, the packed results.

A cuBLAS or CUDA runtime installed with pip (nvidia-cublas, as PyTorch brings) and not on
the loader's path is put on LD_LIBRARY_PATH (the script runs itself again with it), so that
GGML's CUDA backend and llama.cpp's tools load it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import gpu_model
from bench.common.loan import CARRY, carried_llama_cpp_bin, carry_problems, run_on_carry, tar_results, unpack_carry
from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, markdown_table, nvidia_gpus, save_figure, script_parser, write_results

BENCH = Path(__file__).resolve().parent
MODELS_DIR = BENCH / ".models"
REFUSED = 2
# Issue 38's files: what the GPU figures are compared on.
DEFAULT_MODELS = "llama3.2-1b,llama3.2-3b"
# --models 'synthetic': the benchmarks' long-standing 1.6B Gemma 3 file
SYNTHETIC_PRESET = "gemma3-1.6b"
# In this order, each on every model before the next: the headline figures first, so a
# spent budget skips the diagnostic step table rather than them.
WORKLOADS = ("batched", "single", "chat", "step")
SCRIPTS = {"batched": "bench.engine.batched", "single": "bench.engine.single_stream",
           "chat": "bench.serving.chat_trace", "step": "bench.engine.step_overhead"}   # run with -m from the root
# A workload still running when the budget is spent gets this long to finish before it is stopped.
GRACE_S = 60
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n",
           "Water boils at a temperature of", "The capital of France is Paris. The capital of Japan is"]
# Marks the process that already set LD_LIBRARY_PATH, so it runs itself again at most once.
_REEXEC_ENV = "PYLLAMA_DEVICE_BENCH_LIBS"


def pip_cuda_library_dirs() -> list[str]:
    """Folders of CUDA libraries installed with pip (nvidia-cublas, nvidia-cuda-runtime):
    nvidia/cu13/lib for CUDA 13, nvidia/<library>/lib before it."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    dirs = set()
    for root in spec.submodule_search_locations:
        for lib in Path(root).glob("*/lib"):
            if any(lib.glob("libcublas.so*")) or any(lib.glob("libcudart.so*")):
                dirs.add(str(lib))
    return sorted(dirs)


def put_cuda_libraries_on_path() -> None:
    """Run this script again with pip's CUDA libraries on LD_LIBRARY_PATH (the loader reads it
    at start only), so GGML's CUDA backend here and llama.cpp's tools as children find them."""
    if os.environ.get(_REEXEC_ENV):
        return
    current = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    missing = [d for d in pip_cuda_library_dirs() if d not in current]
    if not missing:
        return
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(current + missing), _REEXEC_ENV: "1"}
    os.execve(sys.executable, [sys.executable, "-m", "bench.device_bench", *sys.argv[1:]], env)


def ggml_gpus() -> list:
    """The GPUs the installed GGML lists (pyllama_paged.engine.worker.devices.Device)."""
    from pyllama_paged.engine import list_devices
    return [d for d in list_devices() if d.is_gpu]


def refuse(message: str) -> int:
    """Say why nothing runs; the exit code that means 'refused'."""
    print(f"device_bench: {message}", file=sys.stderr)
    return REFUSED


# ---- the functional check ------------------------------------------------------------

def greedy_answers(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of prompts, all added at once (one batch) and stepped to the end."""
    from pyllama_paged.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    answers: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            answers[out.request_id] += [e.token_id for e in out.events]
    return [answers[i] for i in ids]


def functional_check(args) -> int:
    """The engine on a GGML GPU device against the CPU: placement and greedy agreement."""
    from pyllama_paged.engine import EngineConfig, LLMEngine, Model
    from pyllama_paged.testing.agreement import assert_greedy_agree, engine_logits
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    gpus = ggml_gpus()
    if not gpus:
        return refuse("GGML lists no GPU: this libggml-python is built for the CPU only, or no driver exposes "
                      "a device (a software Vulkan device needs GGML_VK_VISIBLE_DEVICES=0)")
    if not 0 <= args.main_gpu < len(gpus):
        return refuse(f"--main-gpu {args.main_gpu}: GGML lists {len(gpus)} GPU(s)")
    device = gpus[args.main_gpu]
    print(f"device: {device.name} ({device.description}), {device.memory_total / 2**30:.1f} GiB")
    config = dict(n_ctx=256, n_threads=args.threads, n_batch=128, block_size=16, kv_tokens=4 * 256)
    engines, models = {}, []
    try:
        for side, ngl in (("cpu", 0), ("gpu", -1)):
            model = Model(args.model, n_gpu_layers=ngl, main_gpu=args.main_gpu)
            models.append(model)
            engines[side] = LLMEngine.from_config(EngineConfig(**config, n_gpu_layers=ngl, main_gpu=args.main_gpu),
                                                  model=model, eot_ids=[])
        placement = models[1].layer_placement()
        on_cpu = [i for i, where in enumerate(placement) if where == "CPU"]
        print(f"placement: {len(placement) - len(on_cpu)} of {len(placement)} (layers + output head) on "
              f"{device.name}")
        tokenizer = Tokenizer.from_metadata(models[0].metadata)
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        cpu = [greedy_answers(engines["cpu"], [p], args.max_tokens)[0] for p in prompts]   # each alone
        gpu = greedy_answers(engines["gpu"], prompts, args.max_tokens)                      # one batch
        # The head may stay on the CPU where the device binds less than it in one tensor (the
        # software device: 128 MiB, the default model's head 170 MiB); a layer may not.
        head = len(placement) - 1
        if head in on_cpu:
            print(f"output head on the CPU: {device.name} cannot bind it in one tensor")
        layers_on_cpu = [i for i in on_cpu if i != head]
        failures = [] if not layers_on_cpu else [f"n_gpu_layers=-1 left these layers on the CPU: {layers_on_cpu}"]
        judge = engine_logits(engines["cpu"].runner)
        for text, p, want, got in zip(PROMPTS, prompts, cpu, gpu):
            same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
            try:
                assert_greedy_agree(p, want, got, judge)
                verdict = "ok"
            except AssertionError as exc:
                verdict = f"FAIL: {exc}"
                failures.append(verdict)
            print(f"{text!r}: {same}/{len(want)} tokens as on the CPU, {verdict}\n"
                  f"  gpu: {tokenizer.decode(got)!r}")
    finally:
        for engine in engines.values():
            engine.close()
        for model in models:
            model.close()
    print("functional check: " + ("passed" if not failures else "FAILED\n  " + "\n  ".join(failures)))
    return 0 if not failures else 1


# ---- the benchmark -------------------------------------------------------------------

def llama_cpp_bin(args) -> Path | None:
    """llama.cpp's CUDA tools: --llama-cpp-bin, else the carry's (None: neither; this script
    never builds them: the GPU machine reaches no network and a build would spend the loan)."""
    if args.llama_cpp_bin:
        return Path(args.llama_cpp_bin)
    return carried_llama_cpp_bin()


def llama_cpp_lists_cuda(bin_dir: Path) -> bool:
    """Whether llama.cpp's tools were built with CUDA (--list-devices names a CUDA device)."""
    run = subprocess.run([str(bin_dir / "llama-batched-bench"), "--list-devices"], capture_output=True,
                         text=True, timeout=120)
    return "CUDA" in run.stdout + run.stderr


def resolve_model(name: str) -> tuple[str, str, str | None]:
    """A --models entry as (label, GGUF path, the synthetic preset that writes it or None);
    writes nothing."""
    if name == "default":
        from pyllama_paged.engine import default_model_path
        return name, default_model_path(), None
    from pyllama_paged.testing.synthetic_presets import PRESETS
    preset = SYNTHETIC_PRESET if name == "synthetic" else name
    if preset in PRESETS:
        return name, str(MODELS_DIR / PRESETS[preset].file_name), preset
    return Path(name).stem, name, None


def write_model(path: str, preset: str | None) -> None:
    """Write a preset's file where it is missing (under a temporary name first, so a run stopped
    halfway leaves no file that looks whole)."""
    if preset is None or Path(path).exists():
        return
    from pyllama_paged.testing import synthetic_gguf
    t0 = time.monotonic()
    partial = Path(path).with_suffix(".partial")
    synthetic_gguf.write(partial, preset)
    os.replace(partial, path)
    print(f"wrote {path} ({preset}) in {time.monotonic() - t0:.0f} s", flush=True)


def workload_argv(workload: str, args, bin_dir: Path | None, gpu_layers: int) -> list[str] | None:
    """A workload script's arguments besides --model and --out (bin_dir None: ours alone; None
    where the workload cannot run without llama.cpp)."""
    common = ["--threads", str(args.threads), "--gpu-layers", str(gpu_layers)]
    ours_only = ["--sides", "ours"]
    if workload == "batched":
        peer = ours_only if bin_dir is None else ["--llama-batched-bench", str(bin_dir / "llama-batched-bench")]
        return ["--npl", *args.npl.split(","), *peer, *common, *shlex.split(args.batched_args)]
    if workload == "single":
        if bin_dir is None:   # single_stream.py always runs llama-bench beside ours
            return None
        return ["--llama-bench", str(bin_dir / "llama-bench"), *common, *shlex.split(args.single_args)]
    if workload == "chat":
        peer = ours_only if bin_dir is None else ["--llama-server", str(bin_dir / "llama-server")]
        return [*peer, *common, *shlex.split(args.chat_args)]
    if workload == "step":
        peer = ours_only if bin_dir is None else ["--llama-batched-bench", str(bin_dir / "llama-batched-bench")]
        # a device always takes the gather path: the CPU operator's rows would time the same thing
        return ["--paths", "gather", *peer, *common, *shlex.split(args.step_args)]
    raise ValueError(f"unknown workload {workload!r}: choose from {', '.join(WORKLOADS)}")


def workload_plan(args, models: dict[str, str], bin_dir: Path | None, out_dir: Path,
                  gpu_layers: int = -1) -> list[dict]:
    """Every (model, workload) run in order, each with its command line (None: cannot run)."""
    plan = []
    for workload in args.workloads.split(","):
        for label, path in models.items():
            argv = workload_argv(workload, args, bin_dir, gpu_layers)
            cmd = argv and [sys.executable, "-m", SCRIPTS[workload], "--model", path, "--out", str(out_dir / label),
                            *argv]
            plan.append({"model": label, "workload": workload, "cmd": cmd})
    return plan


def run_command(cmd: list[str], timeout: float) -> int | None:
    """Run cmd in a process group of its own; its exit status, or None when it ran past timeout
    (then the group is stopped: a workload's servers with it)."""
    proc = subprocess.Popen(cmd, start_new_session=True, cwd=BENCH.parent)   # the checkout's root: -m finds bench
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        return None


def run_plan(plan: list[dict], budget_s: float, started: float) -> dict:
    """Run the plan's commands in turn within budget_s seconds from `started` (time.monotonic);
    {model: {workload: {"result": ok, failed, timed out or skipped, "detail", "elapsed_s"}}}."""
    status: dict = {}
    for item in plan:
        label, workload, cmd = item["model"], item["workload"], item["cmd"]
        spent = time.monotonic() - started
        if cmd is None:
            entry = {"result": "skipped", "detail": "needs llama.cpp's tools (--ours-only)", "elapsed_s": 0.0}
        elif spent >= budget_s:
            entry = {"result": "skipped", "detail": f"the budget of {budget_s:.0f} s was spent ({spent:.0f} s)",
                     "elapsed_s": 0.0}
        else:
            print(f"== {label}: {workload} ({spent:.0f} s of {budget_s:.0f} s spent)\n   {shlex.join(cmd)}",
                  flush=True)
            t0 = time.monotonic()
            code = run_command(cmd, timeout=budget_s - spent + GRACE_S)
            took = time.monotonic() - t0
            script = Path(cmd[1]).name
            entry = ({"result": "ok", "detail": None} if code == 0 else
                     {"result": "timed out", "detail": f"{script} stopped after {took:.0f} s"} if code is None else
                     {"result": "failed", "detail": f"{script} exited with {code}"})
            entry["elapsed_s"] = took
        print(f"== {label}: {workload}: {entry['result']} ({entry['elapsed_s']:.0f} s)"
              + (f": {entry['detail']}" if entry["detail"] else ""), flush=True)
        status.setdefault(label, {})[workload] = entry
    return status


def _ratio(ours, theirs):
    return ours / theirs if ours is not None and theirs else None


def summary_rows(out_dir: Path, status: dict) -> list[dict]:
    """ours / llama.cpp per model, workload and setting, read back from the workloads' JSON."""
    rows = []
    for label, workloads in status.items():
        for workload, entry in workloads.items():
            if entry["result"] != "ok":
                rows.append({"model": label, "workload": workload, "setting": entry["result"],
                             "error": entry["detail"]})
                continue
            base = {"model": label}
            if workload == "batched":
                data = json.loads((out_dir / label / "batched.json").read_text())
                for r in data["table"]:
                    rows.append({**base, "workload": "batched t/s", "setting": f"npl {r['npl']}",
                                 "llama.cpp": r["llama-batched-bench t/s"], "ours": r["ours t/s"],
                                 "ours / llama.cpp": r["ours / llama.cpp"]})
            elif workload == "single":
                data = json.loads((out_dir / label / "single_stream.json").read_text())
                for key, size in (("tg", data["params"]["ntg"]), ("pp", data["params"]["npp"])):
                    theirs, ours = data["llama_bench"][key], data["ours"][key]
                    rows.append({**base, "workload": f"single-stream {key} t/s", "setting": f"{key}{size}",
                                 "llama.cpp": theirs, "ours": ours, "ours / llama.cpp": _ratio(ours, theirs)})
            elif workload == "step":
                data = json.loads((out_dir / label / "step_overhead.json").read_text())
                for r in data["table"]:
                    theirs, ours = r["llama-batched-bench ms/step"], r["ms/step"]
                    # a time: below 1 is ours ahead
                    rows.append({**base, "workload": "step ms (lower is better)", "setting": f"npl {r['npl']}",
                                 "llama.cpp": theirs, "ours": ours, "ours / llama.cpp": _ratio(ours, theirs),
                                 "ours via LLMEngine": r["engine ms/step"], "nodes": r["nodes"],
                                 "inputs": r["inputs"]})
            else:
                data = json.loads((out_dir / label / "chat_trace.json").read_text())
                for temp in sorted({r["temperature"] for r in data["runs"].values()}):
                    at_temp = [r for r in data["runs"].values() if r["temperature"] == temp]
                    ours = next((r for r in at_temp if r["side"] == "ours"), None)
                    if not ours:
                        continue
                    # each llama-server configuration the trace ran, as its own rows
                    for peer in [r for r in at_temp if r["side"] != "ours"] or [None]:
                        setting = f"t={temp:g}" + (f", {peer['side']}" if peer else "")
                        for metric, key in (("chat tokens/s", "tokens_per_s"), ("chat TTFT p50 s", "ttft_p50"),
                                            ("chat ITL p50 s", "itl_p50")):
                            theirs = peer[key] if peer else None
                            rows.append({**base, "workload": metric, "setting": setting, "llama.cpp": theirs,
                                         "ours": ours[key], "ours / llama.cpp": _ratio(ours[key], theirs)})
    return rows


def run_times(status: dict) -> list[dict]:
    """Each workload run's result and seconds, in the order run."""
    runs = [{"model": label, "workload": w, "result": e["result"], "s": e["elapsed_s"]}
            for label, workloads in status.items() for w, e in workloads.items()]
    return sorted(runs, key=lambda r: (WORKLOADS.index(r["workload"]) if r["workload"] in WORKLOADS else 99))


THROUGHPUT = ("batched t/s", "single-stream tg t/s", "single-stream pp t/s", "chat tokens/s")


def plot(path: Path, rows: list[dict], gpu_name: str) -> None:
    """Bars of ours / llama.cpp for the throughput rows (higher is better for ours)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = [r for r in rows if r["workload"] in THROUGHPUT and r.get("ours / llama.cpp") is not None]
    if not bars:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(bars) + 2), 4))
    ax.bar(range(len(bars)), [r["ours / llama.cpp"] for r in bars])
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks(range(len(bars)), [f"{r['model']}\n{r['workload']}\n{r['setting']}" for r in bars],
                  fontsize=7, rotation=90)
    ax.set(ylabel="ours / llama.cpp (throughput)", title=f"GPU: {gpu_name}, every layer on the GPU")
    save_figure(fig, path)


def benchmark(args, gpus: list[dict], started: float) -> int:
    """The side-by-side runs on the first visible NVIDIA GPU."""
    cuda = [d for d in ggml_gpus() if d.name.startswith("CUDA")]
    if not cuda:
        return refuse("the installed libggml-python has no CUDA backend (GGML lists no CUDA device): build and "
                      "install it with bench/build_ggml_cuda.sh (see this script's docstring)")
    gpu = gpus[0]
    bin_dir = None if args.ours_only else llama_cpp_bin(args)
    if bin_dir is None and not args.ours_only:
        return refuse("llama.cpp's CUDA tools are not here: build the carry with bench/gpu_carry.sh (it brings "
                      "them), or pass --llama-cpp-bin or --ours-only")
    if bin_dir is not None and not llama_cpp_lists_cuda(bin_dir):
        return refuse(f"llama.cpp's tools in {bin_dir} list no CUDA device: build them with "
                      "bench/build_llama_cpp.sh --cuda")
    slug = "".join(c if c.isalnum() else "-" for c in gpu["name"]).strip("-").lower()
    out_dir = Path(args.out) / slug
    models = {}
    for name in args.models.split(","):
        label, path, preset = resolve_model(name)
        write_model(path, preset)
        models[label] = path
    status = run_plan(workload_plan(args, models, bin_dir, out_dir), args.budget_s, started)
    rows = with_predictions(summary_rows(out_dir, status), gpu["name"])
    times = run_times(status)
    notes = (f"Every layer and the output head on {gpu['name']} on both sides; {args.threads} CPU threads; "
             f"llama.cpp with flash attention on (step: the better of on and off). "
             f"Each workload's own table, notes and plot are in its model's folder beside this file "
             f"(batched.md, single_stream.md, chat_trace.md, step_overhead.md). "
             + ("llama.cpp: not run (--ours-only)." if bin_dir is None else
                f"llama.cpp: the llama-cpp-python 0.3.36 sdist's tools built with CUDA ({bin_dir}).")
             + f"\n\nRuns (budget {args.budget_s:.0f} s, {time.monotonic() - started:.0f} s in all):\n\n"
             + markdown_table(times))
    write_results("device_bench", {"params": vars(args), "status": status, "llama_cpp_bin": bin_dir,
                                   "models": models}, rows,
                  out_dir=out_dir, title=f"GPU benchmark: ours vs llama.cpp on {gpu['name']}", notes=notes,
                  extra_machine={"gpus": gpus, "ggml_gpus": [d.description for d in cuda]})
    plot(out_dir / "device_bench.png", rows, gpu["name"])
    print(markdown_table(rows))
    print(markdown_table(times))
    if args.tar:
        print(f"results packed into {tar_results(out_dir, Path(args.tar))}")
    return 0 if all(e["result"] == "ok" for w in status.values() for e in w.values()) else 1


def with_predictions(rows: list[dict], gpu_name: str) -> list[dict]:
    """Each measured row with our predicted figure beside it (bench/common/gpu_model.py)."""
    device = gpu_model.gpu_device(gpu_name)
    table = gpu_model.predictions(device) if device else []
    return [{**r, "ours predicted": gpu_model.prediction_for(table, gpu_name, r["model"], r["workload"],
                                                              r["setting"])} for r in rows]


def dry_run(args) -> int:
    """Every step of a loan that needs no GPU, on this machine: the carry unpacked and checked,
    the models, the plan's command lines, the predictions the measurements will stand beside, and
    the results packed as a loan brings them back. Exit 1 when a step found something missing."""
    problems = []
    print(f"1. GPU: {', '.join(g['name'] for g in nvidia_gpus()) or 'none here: its calls are skipped'}")
    carry = Path(args.carry)
    bin_dir = Path(args.llama_cpp_bin) if args.llama_cpp_bin else Path("<carry>/llama.cpp/bin")
    if carry.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            found = carry_problems(unpack_carry(carry, Path(tmp)))
        problems += [f"carry: {p}" for p in found]
        print(f"2. carry {carry} ({carry.stat().st_size / 2**20:.1f} MiB): " + ("complete" if not found else
                                                                              "; ".join(found)))
    else:
        problems.append(f"carry: no {carry}: build it with bench/gpu_carry.sh")
        print(f"2. {problems[-1]}")
    models = {}
    for name in args.models.split(","):
        label, path, preset = resolve_model(name)
        models[label] = path
        print(f"3. model {label}: {path}" + ("" if Path(path).exists() else
                                             f" (written from preset {preset} on the loan)" if preset else " MISSING"))
        if not preset and not Path(path).exists():
            problems.append(f"model {path} is missing")
    gpu_name = args.dry_run_gpu
    out_dir = Path(args.out) / ("".join(c if c.isalnum() else "-" for c in gpu_name).strip("-").lower() + "-dry-run")
    plan = workload_plan(args, models, None if args.ours_only else bin_dir, out_dir)
    for item in plan:
        print(f"4. {item['model']} {item['workload']}: " + (shlex.join(item["cmd"]) if item["cmd"] else "skipped"))
    device = gpu_model.gpu_device(gpu_name)
    rows = [{"model": r["model"], "workload": r["workload"], "setting": r["setting"], "ours predicted": r["ours"],
             "llama.cpp predicted": r["llama.cpp"], "ours": None, "llama.cpp": None}
            for r in gpu_model.predictions(device)] if device else []
    print(f"5. predictions on {gpu_name} beside the measurements to come:\n" + markdown_table(rows))
    write_results("device_bench", {"dry_run": True, "plan": plan, "problems": problems}, rows, out_dir=out_dir,
                  title=f"GPU benchmark, dry run (predicted on {gpu_name})")
    packed = tar_results(out_dir, Path(args.tar) if args.tar else out_dir.parent / "back")
    print(f"6. results packed into {packed} (at most 8 files come back)")
    print("dry run: " + ("every step ready" if not problems else "MISSING\n  " + "\n  ".join(problems)))
    return 0 if not problems else 1


def parser():
    """The command line's options."""
    ap = script_parser(__doc__)
    ap.add_argument("--functional-check", action="store_true",
                    help="on any GPU GGML lists (Vulkan's lavapipe too): check the engine there against the "
                         "CPU, print no timings")
    ap.add_argument("--models", default=DEFAULT_MODELS,
                    help="'default', 'synthetic', presets of pyllama_paged/testing/synthetic_presets.py "
                         "(written to bench/.models/ on first use) or GGUF paths")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="of " + ", ".join(WORKLOADS))
    ap.add_argument("--budget-s", type=float, default=420,
                    help=f"seconds from the start after which the workloads left are skipped (one still "
                         f"running is stopped {GRACE_S} s later)")
    ap.add_argument("--npl", default="1,16,64", help="batched: parallel sequences")
    ap.add_argument("--batched-args", default="--npp 128 --ntg 128",
                    help="more arguments for bench/engine/batched.py")
    ap.add_argument("--single-args", default="--npp 512 --ntg 128 --repeats 3",
                    help="more arguments for bench/engine/single_stream.py")
    ap.add_argument("--chat-args", default="--requests 32 --rate 16 --peers np8,np32-kvu --ctx 16384",
                    help="more arguments for bench/serving/chat_trace.py")
    ap.add_argument("--step-args", default="--npl 1 16 64 --npp 128 --ntg 128",
                    help="more arguments for bench/engine/step_overhead.py (always --paths gather)")
    ap.add_argument("--llama-cpp-bin", default=None, help="llama.cpp's CUDA bin folder (default: the carry's; never built here)")
    ap.add_argument("--ours-only", action="store_true",
                    help="our engine's figures alone, where llama.cpp's CUDA tools are not built")
    ap.add_argument("--carry", default=str(CARRY),
                    help="bench/gpu_carry.sh's file: unpacked and run on when present (GGML with CUDA, our "
                         "library, the Python wheels, llama.cpp's tools)")
    ap.add_argument("--tar", default=None, help="also pack the results into DIR/device_bench.tar.xz (a loan: $OUT)")
    ap.add_argument("--dry-run", action="store_true",
                    help="walk every step of a loan that needs no GPU (carry, models, plan, predictions, packing)")
    ap.add_argument("--dry-run-gpu", default="NVIDIA H100 80GB HBM3", help="--dry-run: the GPU to predict for")
    ap.add_argument("--main-gpu", type=int, default=0, help="which GPU (functional check: of GGML's)")
    add_options(ap, threads=min(8, os.cpu_count() or 1), model=None, max_tokens=16, out=str(RESULTS_DIR / "device"),
                helps={"model": "functional check: the GGUF (default: the embedded model)",
                       "max_tokens": "functional check: tokens per answer"})
    return ap


def main(argv=None) -> int:
    """Refuse without an NVIDIA GPU, else the functional check or the benchmark."""
    started = time.monotonic()
    ap = parser()
    args = ap.parse_args(argv)
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        ap.error(f"--workloads: unknown {', '.join(sorted(unknown))} (choose from {', '.join(WORKLOADS)})")

    if args.dry_run:
        return dry_run(args)
    gpus = nvidia_gpus()
    if not gpus and not args.functional_check:
        return refuse("no NVIDIA GPU here (nvidia-smi is absent or lists none): the device benchmark needs one. "
                      "--functional-check runs a short check, without timings, on any GPU GGML lists.")
    if not args.functional_check:   # the check runs on the GGML installed here (Vulkan's too)
        run_on_carry(Path(args.carry), "bench.device_bench", sys.argv[1:] if argv is None else list(argv))
    put_cuda_libraries_on_path()
    if args.functional_check:
        return functional_check(args)
    if not 0 <= args.main_gpu < len(gpus):
        return refuse(f"--main-gpu {args.main_gpu}: nvidia-smi lists {len(gpus)} GPU(s)")
    # Both sides see the chosen GPU alone, as their device 0 (numbered as nvidia-smi does).
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[args.main_gpu]["index"]
    return benchmark(args, [gpus[args.main_gpu]], started)


if __name__ == "__main__":
    sys.exit(main())
