"""The one mapping from the sampling fields users send to SamplingParams.

Each surface names and defaults the fields its own way: the Python API as
llama-cpp-python does, Ollama's `options` as Ollama does, OpenAI's request
fields as OpenAI does. A Surface holds those names and defaults; the rules
(stop as a string or a list, an unset or non-positive max_tokens, a seed from
the model, validation) are applied here, once, for all of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..engine import SamplingParams


@dataclass(frozen=True)
class Surface:
    """How one API names and defaults the sampling fields."""

    defaults: Mapping[str, Any]
    renames: Mapping[str, str] = field(default_factory=dict)   # API field -> SamplingParams field
    unset_max_tokens: int = 0   # what an absent or non-positive max_tokens means (0: to the context)


PYTHON = Surface({"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.0})
# Ollama's own defaults (its api/types.go): repeat_penalty 1.0, num_predict -1 (to the context)
OLLAMA = Surface({"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.0},
                 renames={"num_predict": "max_tokens"})
OPENAI = Surface({"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0})

_FIELDS = set(SamplingParams.__dataclass_fields__)

# A model without a chat template (a base model) continues text and seldom stops on its own:
# the answer length of `pyllama-paged run` without -n, and of a request to such a model that
# leaves its limit unset, on every API (the server's cap would let it ramble for thousands)
BASE_MODEL_MAX_TOKENS = 128


def sampling_params(surface: Surface, fields: Mapping[str, Any], **overrides) -> SamplingParams:
    """SamplingParams from the fields a caller gave (None = not given) over the
    surface's defaults; overrides (e.g. the server's max_tokens cap) fill fields
    still unset. Fields that are not sampling fields are ignored. Raises
    PagedError naming the first invalid field."""
    values = dict(surface.defaults)
    for key, value in fields.items():
        key = surface.renames.get(key, key)
        if value is not None and key in _FIELDS:
            values[key] = value
    if values.get("max_tokens") is not None and values["max_tokens"] <= 0:
        del values["max_tokens"]   # unset: the surface's default (e.g. Ollama's num_predict -1)
    if values.get("seed") == -1:
        values["seed"] = None      # -1 asks for a random seed, as in llama.cpp
    for key, value in overrides.items():
        if values.get(key) is None and value is not None:
            values[key] = value
    stop = values.get("stop")
    values["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
    if values.get("max_tokens") is None:
        values["max_tokens"] = surface.unset_max_tokens
    return SamplingParams(**values)   # checks itself
