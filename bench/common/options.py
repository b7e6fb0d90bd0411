"""The options many benchmark scripts take, declared once: a script names the ones it takes, each
with its own default, and gets the same flag, type and help as every other script that takes it.

    add_options(ap, threads=2, model=None, out=str(RESULTS_DIR))

declares --threads (int), --model and --out in that order. `helps` gives a script its own help for
an option whose meaning it narrows (llama-server's -c for --ctx, say); an option that differs in
more than its help (another type, nargs, action) is the script's own and stays declared there.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping

# The shared options by their attribute name (the flag is --name with "-" for "_"): type and help.
SHARED: dict[str, tuple[type | None, str]] = {
    "model": (None, "GGUF (default: the embedded default model)"),
    "threads": (int, "CPU threads"),
    "ctx": (int, "context (tokens)"),
    "n_ctx": (int, "context of a sequence (tokens)"),
    "block_size": (int, "paged block size (tokens)"),
    "max_seqs": (int, "sequences scheduled at once"),
    "kv_budget": (int, "our KV pool (tokens)"),
    "budget_tokens": (int, "KV budget (tokens, both sides)"),
    "gpu_layers": (int, "layers on the GPU on both sides (-1: all); needs GPU builds of both"),
    "npp": (int, "prompt tokens per sequence"),
    "ntg": (int, "tokens generated per sequence"),
    "max_tokens": (int, "tokens per answer"),
    "temperature": (float, "sampling temperature"),
    "rate": (float, "Poisson arrivals per second"),
    "system_tokens": (int, "tokens of a system prompt"),
    "repeats": (int, "runs per measurement"),
    "seed": (int, "random seed"),
    "port": (int, "server port (default: a free one)"),
    "sides": (None, "which sides run, comma separated"),
    "llama_server": (None, "llama-server binary (default: build it)"),
    "llama_batched_bench": (None, "llama-batched-bench binary (default: build it)"),
    "out": (None, "output directory"),
    "out_dir": (None, "output directory"),
}


def add_options(ap: argparse.ArgumentParser, helps: Mapping[str, str] | None = None, **defaults: Any) -> None:
    """Declare the shared options named by the keywords (name=default), in their order."""
    helps = helps or {}
    unknown = set(defaults).difference(SHARED) | set(helps).difference(defaults)
    if unknown:
        raise ValueError(f"{', '.join(sorted(unknown))}: not a shared option, or a help for one not taken")
    for name, default in defaults.items():
        kind, text = SHARED[name]
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=helps.get(name, text))
