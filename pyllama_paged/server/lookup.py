"""The one way a route finds the model a request names: served, named, or stored (loaded
on first use), or a 404 worded once, which each API shows in its own error shape."""

from __future__ import annotations

from .generation import APIError
from .registry import ModelRegistry, ServedModel


def model_not_found(registry: ModelRegistry, name: str | None, param: str = "model") -> APIError:
    """The 404 for a model name nothing here answers to, listing the names that do."""
    return APIError(404, f"model '{name}' not found (it does not exist on this server); available: "
                    f"{', '.join(registry.names())}", param, code="model_not_found")


async def find_model(registry: ModelRegistry, name: str | None, param: str = "model") -> ServedModel:
    """The served model for a name (None or '': the first one; a stored one is loaded on
    first use), or the 404 naming request field param."""
    served = await registry.resolve(name)
    if served is None:
        raise model_not_found(registry, name, param)
    return served
