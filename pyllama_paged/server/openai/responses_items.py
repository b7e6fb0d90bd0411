"""Responses API items both ways: the input items a client sends (messages,
function calls and their outputs) as Chat Completions messages, which
tools/messages.py and the chat templates already read; and an answer (thinking, text
and parsed tool calls) as output items and the response object."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ...tools.calls import ToolCall
from ..generation import APIError

ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "refusal")
_UNSUPPORTED_PARTS = {"input_file": "files", "input_audio": "audio"}


def new_id(prefix: str) -> str:
    """An id in OpenAI's style (resp_..., msg_..., fc_...)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(where: str, message: str) -> APIError:
    return APIError(400, f"{where}{message}", "input")


def _image(part: dict, where: str) -> dict:
    """An input_image part as the chat shape's image_url part (the chat path reads or refuses it)."""
    if not isinstance(part.get("image_url"), str):
        raise _bad(where, ": an input_image needs an image_url (a data URL); file ids are not supported")
    return {"type": "image_url", "image_url": {"url": part["image_url"]}}


def _text(content: Any, where: str) -> str | list[dict]:
    """The text of a message's content: a string, or a list of text parts; with input_image
    parts, the chat shape's list of text and image_url parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, ".content must be a string or a list of content parts")
    texts, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            images.append((len(texts), _image(part, f"{where}.content[{j}]")))
            continue
        if kind in _UNSUPPORTED_PARTS:
            raise _bad(f"{where}.content[{j}]", f": {_UNSUPPORTED_PARTS[kind]} are not supported by this model")
        # a refusal part carries its text under "refusal"
        text = part.get("refusal" if kind == "refusal" else "text") if kind in _TEXT_PARTS else None
        if not isinstance(text, str):
            raise _bad(f"{where}.content[{j}]", " must be a text part {\"type\": \"input_text\", \"text\": ...}")
        texts.append(text)
    if not images:
        return "".join(texts)
    parts: list[dict] = [{"type": "text", "text": t} for t in texts]
    for at, image in reversed(images):   # each where it stood among the text parts
        parts.insert(at, image)
    return parts


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(where, f".{key} must be a string")
    return value


def _call(item: dict, where: str) -> dict:
    arguments = _string(item, "arguments", where)
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        raise _bad(where, ".arguments is not valid JSON") from None
    if not isinstance(parsed, dict):
        raise _bad(where, ".arguments must be a JSON object")
    return {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": arguments}}


def input_messages(given: str | list[dict]) -> list[dict]:
    """Chat Completions messages for a Responses input: a string is one user message; a
    function_call joins the assistant turn before it (one turn may call several tools)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        # EasyInputMessage leaves out the type
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(where, f".role {role!r} is not one of {', '.join(ROLES)}")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = _call(item, where)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            continue   # an earlier turn's thinking, passed back: templates leave old thinking out
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": output if isinstance(output, str) else _text(output, where + ".output")})
        else:
            raise _bad(where, f".type {kind!r} is not supported: give message, function_call, "
                       "function_call_output or reasoning items")
    return out


def with_instructions(instructions: str | None, messages: list[dict]) -> list[dict]:
    """The messages after a system message holding instructions (joined to a leading system
    message: templates take one, first)."""
    if not instructions:
        return messages
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "role": "system", "content": instructions + "\n\n" + (messages[0]["content"] or "")}
        return [first] + messages[1:]
    return [{"role": "system", "content": instructions}] + messages


def answer_message(content: str, calls: list[ToolCall]) -> dict:
    """The answer as an assistant message, for the stored conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    return message


def text_part(text: str) -> dict:
    """An output_text content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    """An output message item (no content part yet when text is None)."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def call_item(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict:
    """A function_call output item; arguments as JSON text (empty while streaming them)."""
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments) if arguments is None else arguments}


def reasoning_text(text: str) -> dict:
    """A reasoning item's reasoning_text content part."""
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, thinking: str | None, status: str) -> dict:
    """A reasoning output item: the model's thinking as reasoning text, with no summary (no
    part yet when thinking is None)."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [] if thinking is None else [reasoning_text(thinking)]}


def output_items(content: str, calls: list[ToolCall], status: str, thinking: str = "") -> list[dict]:
    """The output items of a whole answer: its thinking (if any), its text (if any, or no call
    came) then its calls."""
    items = [reasoning_item(new_id("rs"), thinking, status)] if thinking else []
    items += [message_item(new_id("msg"), content, status)] if content or not calls else []
    return items + [call_item(new_id("fc"), c, "completed") for c in calls]


def usage(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict:
    """The usage object (nothing is cached across requests by the API); reasoning_tokens:
    those of output_tokens that were the model's thinking."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)},
            "total_tokens": input_tokens + output_tokens}


class ResponseObject:
    """The response object's fixed fields (id, time, model, the request's settings), and the
    body at any moment of the answer."""

    def __init__(self, model: str, echo: dict[str, Any]):
        self.id, self.created_at, self.model, self.echo = new_id("resp"), int(time.time()), model, echo

    def body(self, status: str, output: list[dict], usage_: dict | None = None, error: dict | None = None) -> dict:
        """The response object with status, output items, usage and error as given."""
        done = status in ("completed", "incomplete", "failed")
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": output, "usage": usage_ if done else None, **self.echo}
