"""The error bodies of the APIs whose shapes more than one place writes: OpenAI's error
object, and Anthropic's error body with its error type per HTTP status. (Ollama's is
{"error": message}.)"""

from __future__ import annotations

# Anthropic's error types by HTTP status (its "Errors" page); anything else is an api_error
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def openai_error_object(message: str, error_type: str, param: str | None, code: str | None) -> dict:
    """OpenAI's error object (the value of "error" in its error bodies and stream events)."""
    return {"message": message, "type": error_type, "param": param, "code": code}
