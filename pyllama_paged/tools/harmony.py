"""gpt-oss's replies in OpenAI's harmony format, read into thinking, answer and tool calls,
whole or one delta at a time.

The prompt ends with `<|start|>assistant`; the model then writes messages, each a header, then
`<|message|>`, the body, and `<|end|>` before the next `<|start|>`:

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...

The reply ends with `<|return|>` after the final message, or with `<|call|>` after a call,
whose recipient (`to=functions.NAME`) stands in the header before or after the channel, with an
optional content type (`<|constrain|>json`), and whose body is the JSON arguments:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

The analysis channel is the thinking; the final channel, and commentary addressed to no one
(a preamble the user may read), the answer; a message to one of the request's functions a
tool call. A message to anything else (gpt-oss's built-in browser or python tools, a function
the request did not offer) is left out, as llama.cpp leaves it. Headers never reach the text.
"""

from __future__ import annotations

import json

from .calls import ToolCall
from .reasoning import ReasoningDelta

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
# What ends a message's body: <|end|>; <|return|> and <|call|> end the generation (control
# tokens, absent from the text unless it was decoded with its special tokens); a <|start|> with
# no <|end|> before it still begins the next message.
_BODY_ENDS = (END, "<|return|>", "<|call|>", START)
_FUNCTIONS = "functions."
# Text of a header: with none of these, what the model wrote before any <|message|> was no
# header but plain text (a model that did not keep to the format).
_HEADER_MARKS = (START, CHANNEL, CONSTRAIN, " to=")


def parse_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header such as `assistant<|channel|>commentary
    to=functions.f <|constrain|>json` (either may be None)."""
    words = header.replace(START, " ").replace(CONSTRAIN, " ").replace(CHANNEL, " " + CHANNEL).split()
    channel = next((w[len(CHANNEL):] for w in words if w.startswith(CHANNEL)), None)
    recipient = next((w[len("to="):] for w in words if w.startswith("to=")), None)
    return channel or None, recipient or None


def _held_back(text: str) -> int:
    """Length of the longest end of text that could begin one of the body's end tags."""
    for n in range(min(len(text), max(map(len, _BODY_ENDS)) - 1), 0, -1):
        tail = text[-n:]
        if any(tag.startswith(tail) for tag in _BODY_ENDS):
            return n
    return 0


class HarmonySplitter:
    """Splits a harmony reply, delta by delta, into thinking, answer and tool calls (given at
    the end). Text that may still be part of a header or an end tag is held until the next
    delta says which, so every way of cutting the reply into deltas gives the same result."""

    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names
        self._held = ""
        self._scanned = 0            # how much of a held header was searched for <|message|>
        self._kind: str | None = None   # the open message: thinking, content, call or hidden (None: in a header)
        self._call_name = ""
        self._call_parts: list[str] = []
        self._calls: list[ToolCall] = []
        self._messages = 0           # messages opened so far

    def feed(self, text: str) -> ReasoningDelta:
        """The thinking and answer text that this delta makes certain."""
        out = ReasoningDelta()
        self._held += text
        while self._held:
            if self._kind is None:
                # a header grows until <|message|>; only its new end is searched each time
                found = self._held.find(MESSAGE, max(0, self._scanned - len(MESSAGE) + 1))
                if found < 0:
                    self._scanned = len(self._held)
                    return out
                self._open(self._held[:found])
                self._held, self._scanned = self._held[found + len(MESSAGE):], 0
                continue
            ends = [(at, tag) for tag in _BODY_ENDS if (at := self._held.find(tag)) >= 0]
            if ends:
                at, tag = min(ends)
                self._write(out, self._held[:at])
                self._close(out)
                # a <|start|> stays: it begins the next header
                self._held = self._held[at + (0 if tag == START else len(tag)):]
                continue
            keep = _held_back(self._held)
            self._write(out, self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            return out
        return out

    def finish(self) -> tuple[ReasoningDelta, list[ToolCall]]:
        """What is still held when the reply ends, and the reply's tool calls. A message cut
        short keeps what it has; an unfinished header is dropped, unless the reply never was
        harmony (no header at all): then that text is the answer."""
        out = ReasoningDelta()
        held, self._held = self._held, ""
        if self._kind is not None:
            self._write(out, held)
            self._close(out)
        elif self._messages == 0 and not any(mark in held for mark in _HEADER_MARKS):
            out.content += held
        calls, self._calls = self._calls, []
        return out, calls

    def _open(self, header: str) -> None:
        """Start a message with this header."""
        self._messages += 1
        channel, recipient = parse_header(header)
        if recipient is not None:
            name = recipient[len(_FUNCTIONS):] if recipient.startswith(_FUNCTIONS) else None
            self._kind = "call" if name in self.tool_names else "hidden"
            self._call_name, self._call_parts = name or "", []
        else:
            self._kind = "thinking" if channel == "analysis" else "content"

    def _write(self, out: ReasoningDelta, text: str) -> None:
        if not text:
            return
        if self._kind == "thinking":
            out.thinking += text
        elif self._kind == "content":
            out.content += text
        elif self._kind == "call":
            self._call_parts.append(text)

    def _close(self, out: ReasoningDelta) -> None:
        """End the open message: a call's arguments are read now (arguments that are not a
        JSON object stay in the answer, as the model wrote them)."""
        if self._kind == "call":
            raw = "".join(self._call_parts)
            try:
                arguments = json.loads(raw) if raw.strip() else {}
            except (ValueError, RecursionError):
                arguments = None
            if isinstance(arguments, dict):
                self._calls.append(ToolCall(self._call_name, arguments))
            else:
                out.content += raw
        self._kind, self._call_parts = None, []


def split_harmony(text: str, tool_names: set[str]) -> tuple[str, str, list[ToolCall]]:
    """(thinking, answer, tool calls) of a whole harmony reply."""
    splitter = HarmonySplitter(tool_names)
    first = splitter.feed(text)
    last, calls = splitter.finish()
    return first.thinking + last.thinking, first.content + last.content, calls
