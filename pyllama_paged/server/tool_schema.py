"""A tool's function as the chat requests of OpenAI and Ollama declare it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ToolFunction(BaseModel):
    """A tool's function: Ollama's fields (OpenAI's add strict)."""
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
