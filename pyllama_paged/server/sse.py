"""Server-sent events, as the OpenAI routes, the Responses API, Anthropic's Messages and
the Ray ingress write them: one writer for the framing, OpenAI's end and error events."""

from __future__ import annotations

import json
from typing import AsyncIterator, Iterable

from fastapi.responses import StreamingResponse

from .error_bodies import openai_error_object

OPENAI_DONE = "data: [DONE]\n\n"   # OpenAI's last event


def sse(data: dict, event: str | None = None) -> str:
    """One event: its data as JSON, after an event: line where the API names its events."""
    named = f"event: {event}\n" if event is not None else ""
    return f"{named}data: {json.dumps(data)}\n\n"


def openai_error_events(message: str, error_type: str, param: str | None = None, code: str | None = None) -> str:
    """How an OpenAI stream ends on an error after its 200: an error event, then the end."""
    return sse({"error": openai_error_object(message, error_type, param, code)}) + OPENAI_DONE


def event_stream(events: AsyncIterator[str] | Iterable[str]) -> StreamingResponse:
    """The response that sends these events as they come."""
    return StreamingResponse(events, media_type="text/event-stream")
