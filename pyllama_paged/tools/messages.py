"""Chat messages as OpenAI and Ollama clients send them (content as a list of
parts, assistant turns that only call tools, tool results) in the one shape the
chat templates read: {"role", "content": str, "tool_calls"?, "tool_call_id"?, "name"?}."""

from __future__ import annotations

import json
from typing import Any

from ..errors import PagedError, RequestError
from ..vision.prompt_images import MAX_IMAGES_PER_REQUEST, image_data

ROLES = ("system", "user", "assistant", "tool")


class MessageError(PagedError):
    """A message the templates cannot take (the request's fault: a 400)."""


class ImageSink:
    """Where a chat's images go when the model reads them: their bytes in order, and the marker
    text each leaves in its message (vision/prompt_images.py)."""

    def __init__(self, marker: str, max_images: int = MAX_IMAGES_PER_REQUEST):
        self.marker, self.max_images = marker, max_images
        self.images: list[bytes] = []

    def take(self, value: Any, where: str) -> str:
        """One image (base64 or a data URL) kept; the marker text that stands for it."""
        if not isinstance(value, str):
            raise MessageError(f"{where} must be a data URL or base64 text")
        if len(self.images) >= self.max_images:
            raise MessageError(f"{where}: at most {self.max_images} images in one request")
        try:
            self.images.append(image_data(value, where))
        except RequestError as e:
            raise MessageError(str(e)) from None
        return self.marker


def _image_part(part: dict, where: str, sink: ImageSink | None) -> str:
    if sink is None:
        raise MessageError(f"{where}: images are not supported by this model")
    url = part.get("image_url")
    return sink.take(url.get("url") if isinstance(url, dict) else url, f"{where}.image_url")


def _text_of(content: Any, where: str, sink: ImageSink | None = None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text") and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "image_url":
                parts.append(_image_part(part, f"{where}.content[{j}]", sink))
            elif kind in ("input_image", "image"):
                raise MessageError(f"{where}.content[{j}]: images are not supported by this model")
            elif kind in ("input_audio", "audio", "file"):
                raise MessageError(f"{where}.content[{j}]: {kind} parts are not supported by this model")
            else:
                raise MessageError(f"{where}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}")
        return "".join(parts)
    raise MessageError(f"{where}.content must be a string, a list of text parts, or null")


def _call(raw: Any, where: str) -> dict:
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise MessageError(f"{where} must have a function with a name")
    args = fn.get("arguments", {})
    if isinstance(args, str):   # OpenAI sends arguments as JSON text
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise MessageError(f"{where}.function.arguments is not valid JSON") from None
    if not isinstance(args, dict):
        raise MessageError(f"{where}.function.arguments must be a JSON object")
    call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(raw.get("id"), str):
        call["id"] = raw["id"]
    return call


def normalize_messages(messages: list[Any], images: ImageSink | None = None) -> list[dict]:
    """The template shape of a client's messages; MessageError names the bad field. With
    images, image parts and Ollama's images (before the message's text) go there, each
    leaving its marker; without, they are refused."""
    out, names = [], {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise MessageError(f"{where} must be an object")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise MessageError(f"{where}.role '{m.get('role')}' is not one of system, user, assistant, tool")
        given = m.get("images")
        if given and images is None:
            raise MessageError(f"{where}.images: images are not supported by this model")
        if given and not isinstance(given, list):
            raise MessageError(f"{where}.images must be a list of base64 images")
        markers = "".join(images.take(v, f"{where}.images[{j}]") for j, v in enumerate(given or ()))
        msg = {"role": role, "content": markers + _text_of(m.get("content"), where, images)}
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise MessageError(f"{where}.tool_calls must be a list on an assistant message")
            msg["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        for key in ("tool_call_id", "name", "tool_name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if role == "tool" and "name" not in msg:
            # OpenAI names the call by id only: the function is the one that call named
            msg["name"] = msg.get("tool_name") or names.get(msg.get("tool_call_id"), "")
        for call in msg.get("tool_calls", ()):
            if "id" in call:
                names[call["id"]] = call["function"]["name"]
        out.append(msg)
    return out
