"""Gemma 4's replies: its thinking channel and its tool calls, as llama.cpp's Gemma 4 parser reads
them (common/parsers/gemma4.cpp at 0c1e570).

A reply may open with the thinking channel, then answer:

    <|channel>thought
    ...the thinking...<channel|>The answer.

and calls a tool by writing, after any answer text, one or more

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

whose arguments are Gemma 4's own notation: an object's keys bare, strings between `<|"|>`
quotes, numbers, true, false and null as in JSON, objects and arrays nested. The reply then
ends with `<|tool_response>` (an end of generation), where the tool's result goes."""

from __future__ import annotations

import re

THOUGHT_OPEN = "<|channel>thought"
THOUGHT_CLOSE = "<channel|>"
CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
_CALL_PREFIX = "call:"
QUOTE = '<|"|>'
# what a call's name may be: up to the arguments' opening brace
_NAME = re.compile(r"[^{<\s]+")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORDS = {"true": True, "false": False, "null": None}
_MAX_DEPTH = 64


class _Malformed(ValueError):
    """Text that is not Gemma 4's argument notation."""


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


def _value(text: str, pos: int, depth: int):
    """The value at pos and the position after it."""
    if depth > _MAX_DEPTH:
        raise _Malformed("nested too deep")
    pos = _skip_space(text, pos)
    if text.startswith(QUOTE, pos):
        end = text.find(QUOTE, pos + len(QUOTE))
        if end < 0:
            raise _Malformed("an unclosed string")
        return text[pos + len(QUOTE):end], end + len(QUOTE)
    if text.startswith("{", pos):
        return _members(text, pos + 1, "}", depth)
    if text.startswith("[", pos):
        return _members(text, pos + 1, "]", depth)
    for word, value in _WORDS.items():
        if text.startswith(word, pos):
            return value, pos + len(word)
    number = _NUMBER.match(text, pos)
    if not number:
        raise _Malformed(f"no value at {pos}")
    literal = number.group()
    return (float(literal) if any(c in literal for c in ".eE") else int(literal)), number.end()


def _members(text: str, pos: int, close: str, depth: int):
    """An object's members (close "}": `key:value`, keys bare up to the colon) or an array's
    items (close "]"), from just after the opening bracket; the value and the position after."""
    out: dict | list = {} if close == "}" else []
    pos = _skip_space(text, pos)
    if text.startswith(close, pos):
        return out, pos + 1
    while True:
        if close == "}":
            colon = text.find(":", pos)
            key = text[pos:colon].strip() if colon >= 0 else ""
            if not key or "}" in key or "," in key:
                raise _Malformed(f"no key at {pos}")
            out[key], pos = _value(text, colon + 1, depth + 1)
        else:
            item, pos = _value(text, pos, depth + 1)
            out.append(item)
        pos = _skip_space(text, pos)
        if text.startswith(close, pos):
            return out, pos + 1
        if not text.startswith(",", pos):
            raise _Malformed(f"expected ',' or '{close}' at {pos}")
        pos = _skip_space(text, pos + 1)


def parse_arguments(text: str) -> dict:
    """The arguments object of a call, `{...}` in Gemma 4's notation (ValueError if it is not one)."""
    text = text.strip()
    if not text.startswith("{"):
        raise ValueError("arguments must be an object")
    value, end = _members(text, 1, "}", 0)
    if end != len(text):
        raise ValueError(f"text after the arguments at {end}")
    return value


def parse_gemma4_calls(text: str, names: set[str]) -> tuple[str, list[tuple[str, dict]]] | None:
    """(content, [(name, arguments)]) of an answer holding Gemma 4 calls; None when a call block
    is not one of the request's functions with readable arguments (the caller then keeps the text)."""
    calls, kept, pos = [], [], 0
    while (start := text.find(CALL_OPEN, pos)) != -1:
        kept.append(text[pos:start])
        body = start + len(CALL_OPEN)
        close = text.find(CALL_CLOSE, body)
        end = len(text) if close < 0 else close
        call = _call(text[body:end], names)
        if call is None:
            return None
        calls.append(call)
        pos = end if close < 0 else close + len(CALL_CLOSE)
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def _call(block: str, names: set[str]) -> tuple[str, dict] | None:
    block = block.strip()
    if not block.startswith(_CALL_PREFIX):
        return None
    name = _NAME.match(block, len(_CALL_PREFIX))
    if not name or (names and name.group() not in names):
        return None
    try:
        return name.group(), parse_arguments(block[name.end():])
    except (ValueError, RecursionError):
        return None
