"""The console script, driven as a user would: run, info, chat with /stats,
/reset and Ctrl-C."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

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
    assert p.returncode == 0 and "KV bytes per token (f16): 18432" in p.stdout
    assert "weights repacked for GGML's CPU GEMM:" in p.stdout
    assert ("llamafile=0" in p.stdout) == ("-DGGML_LLAMAFILE=ON" in p.stdout)   # the rebuild hint
    assert "repack tensor" not in p.stderr   # GGML's per-tensor debug lines are filtered out
    p = subprocess.run(CLI + ["run", "--model", "/nonexistent.gguf", "hi"], capture_output=True,
                       text=True, timeout=120, env=ENV, cwd="/")
    assert p.returncode == 1 and "no such file" in p.stderr


def test_chat_commands_and_ctrl_c():
    proc = subprocess.Popen(CLI + ["chat", "--threads", "2", "-n", "400", "--ctx", "1024"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd="/")
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()

    def wait_for(text, timeout=240):
        end = time.time() + timeout
        while time.time() < end:
            if text in "".join(out):
                return
            time.sleep(0.1)
        raise AssertionError(f"never saw {text!r}; got {''.join(out)[-500:]!r}")

    wait_for("Ctrl-C stops an answer")
    proc.stdin.write("Tell me a very long story about a dragon.\n")
    proc.stdin.flush()
    time.sleep(8)                      # let the answer stream a while
    proc.send_signal(signal.SIGINT)
    wait_for("[stopped]")
    proc.stdin.write("/stats\n")
    proc.stdin.flush()
    wait_for("prefix-cache hit rate")
    proc.stdin.write("/reset\n/exit\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == 0
    text = "".join(out)
    assert "[history cleared]" in text
    # the stopped answer gave its pages back: none in use
    assert "0 used" in text.split("[pages:")[1]
