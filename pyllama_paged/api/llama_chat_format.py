"""llama-cpp-python's llama_chat_format names. Chat formats are Llama(chat_format=...) or the
GGUF's own template here; the multimodal chat handlers (Llava and the other vision
models) are refused when made, with what to use instead: these models read no images."""

from __future__ import annotations

from .llama_compat import CHAT_FORMATS, UnsupportedFeatureError

# llama-cpp-python's vision chat handlers: each needs a CLIP/mmproj projector we do not run
VISION_HANDLERS = ("Llava15ChatHandler", "Llava16ChatHandler", "MoondreamChatHandler", "NanoLlavaChatHandler",
                   "Llama3VisionAlphaChatHandler", "MiniCPMv26ChatHandler", "Qwen25VLChatHandler",
                   "Gemma3ChatHandler")


def vision_refusal(name: str) -> UnsupportedFeatureError:
    """The error for a vision chat handler: images are not supported, and what to use instead."""
    return UnsupportedFeatureError(
        f"{name}: images are not supported (pyllama-paged runs no CLIP/mmproj vision projector). For text chat "
        f"use Llama(chat_format=...) ({', '.join(sorted(CHAT_FORMATS))}) or the GGUF's own template "
        "(chat_format=None); for images, run llama-cpp-python or Ollama beside it.")


def _refused(name: str) -> type:
    def __init__(self, *args, **kwargs):
        raise vision_refusal(name)
    return type(name, (), {"__init__": __init__, "__doc__": f"Refused: {name} needs image support.",
                           "__module__": __name__})


Llava15ChatHandler = _refused("Llava15ChatHandler")
Llava16ChatHandler = _refused("Llava16ChatHandler")
MoondreamChatHandler = _refused("MoondreamChatHandler")
NanoLlavaChatHandler = _refused("NanoLlavaChatHandler")
Llama3VisionAlphaChatHandler = _refused("Llama3VisionAlphaChatHandler")
MiniCPMv26ChatHandler = _refused("MiniCPMv26ChatHandler")
Qwen25VLChatHandler = _refused("Qwen25VLChatHandler")
Gemma3ChatHandler = _refused("Gemma3ChatHandler")


def is_vision_handler(handler) -> bool:
    """Whether a chat_handler (ours or llama-cpp-python's) is one that reads images."""
    return type(handler).__name__ in VISION_HANDLERS or hasattr(handler, "clip_model_path")


def __getattr__(name: str):
    raise AttributeError(f"llama_chat_format.{name} is not provided by pyllama-paged: chat formats are "
                         f"Llama(chat_format=...) ({', '.join(sorted(CHAT_FORMATS))}) or the GGUF's template, "
                         "and a chat_handler may be any callable taking llama-cpp-python's arguments")
