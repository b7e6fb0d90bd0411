"""The engine on a GGML device (a GPU, or Mesa's software Vulkan device in CI), checked
against the float64 reference and the CPU engine. Each check runs in its own process
(`python -m pyllama_paged.testing.device_checks NAME`) and prints one JSON line: a
driver crash is then a failed check with its name, not a dead test session.

Every answer names the device it ran on ("device"), so a log shows the checks ran there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from .engine_runs import chunked_logits

# Tolerances on logits relative to their spread, as tests/engine/test_engine_reference.py:
# f16 KV rounds K/V to 11 bits; q8_0 KV quantizes K, V and the query.
TOLERANCE = {"f16": 2e-2, "q8_0": 8e-2}
ARCH_WEIGHTS = {"gemma3": "q8_0", "llama": "q4_0", "qwen2": "f16", "qwen3": "q4_k"}
PROMPT = [int(x) for x in np.random.default_rng(1).integers(4, 200, size=40)]
EOT = {1}


def _tiny(arch: str, folder: Path) -> str:
    from .reference.tiny_gguf import write_tiny_model

    return write_tiny_model(folder / f"{arch}.gguf", arch, weight_type=ARCH_WEIGHTS[arch])


def _runner(path, n_gpu_layers: int, **kw):
    from ..engine import EngineConfig, Model
    from ..engine.worker.model_runner import ModelRunner

    model = Model(path, n_gpu_layers=n_gpu_layers)
    settings = dict(n_ctx=256, n_threads=2, n_batch=64, block_size=16)
    return model, ModelRunner(model, EngineConfig(**{**settings, **kw}))


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / (want.max() - want.min()))


def check_reference(arch: str) -> dict:
    """One architecture's tiny model: all layers on the device (pages f16 and q8_0, and
    the slab baseline), and a split (the last layer only), against the reference."""
    from .reference.numpy_model import ReferenceModel

    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny(arch, Path(tmp))
        want = ReferenceModel.from_gguf(path).forward(PROMPT)
        out = {}
        for name, ngl, kw in (("all_f16", -1, dict(kv_cache_type="f16")),
                              ("all_q8_0", -1, dict(kv_cache_type="q8_0")),
                              ("all_slab", -1, dict(paged=False, kv_cache_type="f16")),
                              ("last_layer", 1, dict(kv_cache_type="f16"))):
            model, runner = _runner(path, ngl, **kw)
            try:
                got = chunked_logits(runner, PROMPT)
                out[name] = {"error": _relative_error(got, want), "tolerance": TOLERANCE[kw["kv_cache_type"]],
                             "argmax_agreement": float((got.argmax(-1) == want.argmax(-1)).mean()),
                             "placement": model.layer_placement()}
            finally:
                runner.close()
                model.close()
        return out


def check_forks() -> dict:
    """A prompt computed on the device, forked three ways mid-block; each branch appends
    its own tokens (copy-on-write of the shared last page) and must give the reference's
    logits for its whole text."""
    from .reference.numpy_model import ReferenceModel

    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny("llama", Path(tmp))
        ref = ReferenceModel.from_gguf(path)
        model, runner = _runner(path, -1)
        try:
            parent = runner.add_sequence(PROMPT[:37])      # 37 tokens: the third page is shared half full
            runner.prefill(parent)
            errors = []
            branches = [runner.fork(parent) for _ in range(3)]
            tails = [[5 + i, 9 + i, 13 + i] for i in range(3)]
            for seq, tail in zip(branches, tails):
                runner.append_tokens(seq, tail)
                got = runner.step([(seq, len(tail))])
                want = ref.forward(PROMPT[:37] + tail)[-1]
                errors.append(_relative_error(got[-1], want))
            # the parent's own page was not written by its forks
            runner.append_tokens(parent, [7])
            got = runner.step([(parent, 1)])
            errors.append(_relative_error(got[-1], ref.forward(PROMPT[:37] + [7])[-1]))
            return {"errors": errors, "tolerance": TOLERANCE["f16"]}
        finally:
            runner.close()
            model.close()


def check_mixed(arch: str, n_gpu_layers: str = "-1", attention: str = "kernel") -> dict:
    """Steps mixing decode runs and prefill chunks of several lengths in one batch (on a
    device: one flash-attention call per group of equal-length runs, which reorders them),
    each row against the reference's logits at that sequence's position; and the node and
    input counts of decode steps over 1 and 6 sequences (equal: one group, whatever the count)."""
    from .reference.numpy_model import ReferenceModel

    rng = np.random.default_rng(11)
    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny(arch, Path(tmp))
        ref = ReferenceModel.from_gguf(path)
        model, runner = _runner(path, int(n_gpu_layers), attention=attention, n_seq_max=6)
        try:
            texts = [list(rng.integers(4, 300, size=n)) for n in (30, 9, 41, 5, 22, 12)]
            seqs = [runner.add_sequence(t) for t in texts]
            rows = []   # (sequence, position, logits)

            def step(work):
                got = runner.step(work)
                finished = [(i, s.num_tokens - 1) for i, s in ((seqs.index(s), s) for s, _ in work)
                            if s.num_computed == s.num_tokens]
                rows.extend((i, pos, got[k].copy()) for k, (i, pos) in enumerate(finished))

            for i in (0, 2, 4):
                runner.prefill(seqs[i])
                runner.append_tokens(seqs[i], [11 + i])
                texts[i].append(11 + i)
            step([(seqs[0], 1), (seqs[1], 5), (seqs[2], 1), (seqs[3], 3), (seqs[4], 1), (seqs[5], 12)])
            step([(seqs[3], 2), (seqs[1], 4)])
            stats = {}
            for n in (1, 6):
                for i, s in enumerate(seqs[:n]):
                    runner.append_tokens(s, [20 + n])
                    texts[i].append(20 + n)
                step([(s, 1) for s in seqs[:n]])
                stats[n] = runner.step_stats()
            errors = [_relative_error(got, ref.forward(texts[i][:pos + 1])[-1]) for i, pos, got in rows]
            return {"errors": errors, "tolerance": TOLERANCE["f16"], "rows": len(rows),
                    "decode_graphs": {n: (s["nodes"], s["inputs"]) for n, s in stats.items()},
                    "placement": model.layer_placement()}
        finally:
            runner.close()
            model.close()


PROMPTS = [list(np.random.default_rng(i).integers(4, 300, size=n)) for i, n in enumerate([70, 17, 100, 48, 9, 60])]


def _engine(model, num_blocks=None, mode="recompute", free=True):
    from ..engine import EngineConfig, LLMEngine, SchedulerConfig
    from ..engine.worker.model_runner import ModelRunner

    runner = ModelRunner(model, EngineConfig(n_ctx=256, n_threads=2, n_batch=64, block_size=16, num_blocks=num_blocks,
                                             free_window_blocks=free))
    return LLMEngine(runner, EOT, SchedulerConfig(max_num_batched_tokens=64, preemption_mode=mode))


def check_engine() -> dict:
    """The scheduler's whole range on the device with a sliding-window model (tiny Gemma 3,
    window 16): batched greedy requests with window pages given back, swap and recompute
    preemption in a pool too small for all, n=3 samples and beams; answers compared with
    the CPU engine's, each request alone (near-ties allowed as in testing/agreement.py)."""
    from ..engine import Model, SamplingParams
    from .agreement import assert_greedy_agree, engine_logits, run_to_completion

    greedy = SamplingParams(max_tokens=40, temperature=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny("gemma3", Path(tmp))
        cpu = Model(path)
        alone = []
        for p in PROMPTS:
            llm = _engine(cpu, free=False)
            alone.append(run_to_completion(llm, [p], greedy)[0][0][0])
            llm.runner.close()
        reference = _engine(cpu, free=False)
        logits_of = engine_logits(reference.runner)
        device = Model(path, n_gpu_layers=-1)
        out = {"placement": device.layer_placement()}
        try:
            for name, kw in (("batched", {}), ("swap", dict(num_blocks=60, mode="swap")),
                             ("recompute", dict(num_blocks=60, mode="recompute"))):
                llm = _engine(device, **kw)
                got, _ = run_to_completion(llm, PROMPTS, greedy)
                for prompt, g, a in zip(PROMPTS, got, alone):
                    assert set(g) == {0}, f"{name}: unexpected sample indices {set(g)}"
                    assert_greedy_agree(prompt, a, g[0], logits_of, EOT)
                stats = llm.stats()
                out[name] = {"agree": True, "preemptions": stats["preemptions"],
                             "blocks_used_after": stats["blocks_used"]}
                llm.runner.close()
            llm = _engine(device)
            sampled = SamplingParams(max_tokens=30, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3, n=3)
            (samples,), _ = run_to_completion(llm, [list(range(10, 90))], sampled)
            beams = SamplingParams(max_tokens=12, temperature=0, beam_width=3)
            (beam_out,), _ = run_to_completion(llm, [list(range(10, 90))], beams)
            out["samples"] = {"n": len(samples), "lengths": [len(v) for v in samples.values()],
                              "beams": len(beam_out), "blocks_used_after": llm.stats()["blocks_used"]}
            llm.runner.close()
        finally:
            reference.runner.close()
            device.close()
            cpu.close()
        return out


def check_window() -> dict:
    """Several windows long on the device (tiny Gemma 3, window 16, pages given back):
    every position's logits against the reference, and the window group holding only
    what its next query sees."""
    from ..engine.kv.manager import commit_chunks
    from .reference.numpy_model import ReferenceModel

    prompt = [int(x) for x in np.random.default_rng(5).integers(4, 300, size=150)]
    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny("gemma3", Path(tmp))
        want = ReferenceModel.from_gguf(path).forward(prompt)
        model, runner = _runner(path, -1)
        try:
            seq = runner.add_sequence_cached(prompt)
            rows = []
            while seq.num_computed < len(prompt):
                n = min(37, len(prompt) - seq.num_computed)          # chunks that straddle pages
                runner.append_tokens(seq, prompt[seq.num_tokens:seq.num_computed + n])
                items = np.array([(seq.handle, seq.num_computed, n)], dtype=np.int32)
                rows.append(runner.execute(items, all_logits=[True])[0].copy())
                commit_chunks(runner.kv, [(seq, n)])
            held = [len([b for b in runner.kv.block_table(seq.handle, g) if b >= 0])
                    for g in range(runner.kv.n_groups)]
            got = np.concatenate(rows)
            return {"error": _relative_error(got, want), "tolerance": TOLERANCE["f16"],
                    "blocks_held_by_group": held, "placement": model.layer_placement()}
        finally:
            runner.close()
            model.close()


def check_default_model() -> dict:
    """The embedded default model with Llama(n_gpu_layers=-1): its greedy answers against
    the CPU engine's (near-ties allowed), and the block copy/swap round trip on its pools."""
    from ..api.llama import Llama
    from .agreement import assert_greedy_agree, engine_logits

    prompts = ["The three primary colors are", "def fibonacci(n):", "Paris is the capital of"]
    cpu = Llama(n_ctx=512, n_threads=2)
    gpu = Llama(n_ctx=512, n_threads=2, n_gpu_layers=-1)
    try:
        tok = cpu.tokenize
        logits_of = engine_logits(cpu.llm_engine.runner)
        answers = []
        for text in prompts:
            want = cpu(text, max_tokens=24, temperature=0)["choices"][0]["text"]
            got = gpu(text, max_tokens=24, temperature=0)["choices"][0]["text"]
            ids = tok(text.encode())
            assert_greedy_agree(ids, tok(want.encode(), add_bos=False), tok(got.encode(), add_bos=False),
                                logits_of, cpu.llm_engine.eot_ids)
            answers.append({"prompt": text, "cpu": want, "device": got, "same": want == got})
        runner = gpu.llm_engine.runner
        data = np.arange(runner.block_bytes, dtype=np.uint64).astype(np.uint8)
        runner.write_block(3, data)
        runner.copy_blocks([(3, 5)])
        round_trip = bool(np.array_equal(runner.read_block(5), data))
        return {"answers": answers, "placement": gpu._model.layer_placement(), "block_round_trip": round_trip,
                "kv_device_layers": int(_kv_device_layers(runner))}
    finally:
        gpu.close()
        cpu.close()


def _kv_device_layers(runner) -> int:
    from .._native import lib

    return lib.pp_kv_cache_device_layers(runner._cache)


def check_server() -> dict:
    """`pyllama-paged serve --gpu-layers 99` answering a few requests over HTTP like the CPU."""
    import httpx

    from ..api.llama import Llama
    from .agreement import assert_greedy_agree, engine_logits
    from .serving import free_port, stop_server, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "pyllama_paged.cli", "serve", "--gpu-layers", "99",
                                     "--port", str(port), "--threads", "2", "--ctx", "512", "--kv-budget", "4096"],
                                    stdout=f, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, proc, "/api/version", timeout=600, log=log)
            cpu = Llama(n_ctx=512, n_threads=2)
            logits_of = engine_logits(cpu.llm_engine.runner)
            answers = []
            for text in ("The three primary colors are", "Paris is the capital of"):
                body = {"model": "gemma3:270m-base", "prompt": text, "max_tokens": 16, "temperature": 0}
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
                r.raise_for_status()
                got = r.json()["choices"][0]["text"]
                want = cpu(text, max_tokens=16, temperature=0)["choices"][0]["text"]
                # near-ties allowed, as for the Python API
                assert_greedy_agree(cpu.tokenize(text.encode()), cpu.tokenize(want.encode(), add_bos=False),
                                    cpu.tokenize(got.encode(), add_bos=False), logits_of, cpu.llm_engine.eot_ids)
                answers.append({"prompt": text, "cpu": want, "device": got, "agree": True})
            cpu.close()
            (ps,) = httpx.get(f"{url}/api/ps", timeout=30).json()["models"]
            return {"answers": answers, "size_vram": ps["size_vram"], "size": ps["size"]}
        finally:
            stop_server(proc)


def check_limits() -> dict:
    """Asking the device for more than it holds: a KV pool above what it binds in one
    tensor is a clear error, and the same process then serves a model that fits."""
    from ..engine import EngineConfig, Model
    from ..engine.worker.model_runner import ModelRunner
    from ..errors import PagedError

    model = Model(n_gpu_layers=-1)
    try:
        try:
            ModelRunner(model, EngineConfig(n_ctx=512, n_threads=2, kv_bytes=64 * 2**30))
            refused = None
        except PagedError as e:
            refused = str(e)
        runner = ModelRunner(model, EngineConfig(n_ctx=512, n_threads=2))
        seq = runner.add_sequence([2, 651, 1957, 6037, 9692, 659])
        finite = bool(np.isfinite(runner.prefill(seq)).all())
        runner.close()
        return {"refused": refused, "then_runs": finite}
    finally:
        model.close()


CHECKS = {"reference": check_reference, "forks": check_forks, "mixed": check_mixed, "engine": check_engine, "window": check_window,
          "default_model": check_default_model, "server": check_server,
          "limits": check_limits}


def main(argv=None) -> int:
    """Run one check and print its answer as a JSON line (with the device it ran on)."""
    from ..engine import gpu_device

    argv = sys.argv[1:] if argv is None else argv
    name, args = argv[0], argv[1:]
    device = gpu_device(0)
    result = CHECKS[name](*args)
    print(json.dumps({"check": name, "device": device.name, "description": device.description,
                      "result": result}, default=str))
    return 0


def run_check(name: str, *args: str, timeout: float = 1500) -> dict:
    """Run a check in a child process; its JSON answer, or AssertionError with its output
    (a crash of the driver included)."""
    # run from outside any checkout: `-m` puts the working directory first on sys.path, and a
    # source tree there (no compiled library) would shadow the installed package
    proc = subprocess.run([sys.executable, "-m", "pyllama_paged.testing.device_checks", name, *args],
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
                          cwd=tempfile.gettempdir())
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"check"')]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"device check {name} {' '.join(args)} exited with {proc.returncode}:\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    answer = json.loads(lines[-1])
    print(f"device check {name} {' '.join(args)} ran on {answer['device']} ({answer['description']})")
    return answer


if __name__ == "__main__":
    raise SystemExit(main())
