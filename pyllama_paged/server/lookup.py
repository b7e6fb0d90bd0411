"""The one way a route finds the model a request names: served, named, or stored (loaded
on first use), or a 404 worded once, which each API shows in its own error shape."""

from __future__ import annotations

from ..models.embedded import name_hint
from .generation import APIError
from .registry import ModelRegistry, ServedModel


# names a 404 lists (a store of thousands would make every typo an answer of tens of KiB)
LISTED_NAMES = 10


def model_not_found(registry: ModelRegistry, name: str | None, param: str = "model") -> APIError:
    """The 404 for a model name nothing here answers to, listing the first LISTED_NAMES names
    that do (the served ones first) and how many more there are (GET /api/tags lists all)."""
    names = registry.names(LISTED_NAMES)
    listed = ", ".join(names)
    more = registry.name_count() - len(names)
    if len(names) == LISTED_NAMES and more > 0:
        listed += f" and {more} more (GET /api/tags or /v1/models lists them)"
    return APIError(404, f"model '{name}' not found (it does not exist on this server); available: {listed}"
                    f"{name_hint(name)}", param, code="model_not_found")


async def find_model(registry: ModelRegistry, name: str | None, param: str = "model") -> ServedModel:
    """The served model for a name (None or '': the first one; a stored one is loaded on
    first use), or the 404 naming request field param."""
    served = await registry.resolve(name)
    if served is None:
        raise model_not_found(registry, name, param)
    return served
