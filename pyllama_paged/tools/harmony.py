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

The markup is read from the token ids only: `<|channel|>`, `<|message|>`, `<|call|>` and the
rest are special tokens of gpt-oss's vocabulary, and a reply is cut into messages where the
model sampled one of them, never where its text merely spells one (a model echoing a web page or
a user's message that holds `<|call|>` as ordinary text must not make a call it never made).
The text between the markers is the text the answer's deltas carry, so stop strings cut it as
they cut any answer.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import deque
from dataclasses import dataclass

from ..tokenizer.tokenizer import IncrementalDecoder, Tokenizer, TokenType
from .calls import ToolCall
from .reasoning import ReasoningDelta

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
MARKERS = frozenset((START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL))
# What ends a message's body: <|end|>; <|return|> and <|call|> end the generation; a <|start|>
# with no <|end|> before it still begins the next message.
_BODY_ENDS = (END, RETURN, CALL, START)
_FUNCTIONS = "functions."
_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED)


@dataclass(frozen=True)
class HarmonyTokens:
    """A vocabulary's harmony markup: which token ids are which marker."""

    tokenizer: Tokenizer
    markers: dict[int, str]   # token id -> the marker it is


# per tokenizer, its markers only: a value holding the tokenizer would keep its key alive
_found: "weakref.WeakKeyDictionary[Tokenizer, dict[int, str]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def harmony_tokens(tokenizer: Tokenizer) -> HarmonyTokens:
    """The tokenizer's harmony markers: its special (control or user-defined) tokens whose text
    is one, every such id (a vocabulary may hold a marker twice); found once per tokenizer."""
    with _lock:
        markers = _found.get(tokenizer)
        if markers is None:
            types = tokenizer.token_types
            markers = {i: t for i, t in enumerate(tokenizer.tokens) if t in MARKERS and types[i] in _SPECIAL_TYPES}
            _found[tokenizer] = markers
    return HarmonyTokens(tokenizer, markers)


def header_fields(parts: list[tuple[bool, str]]) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header given as (is a marker, text) parts, such as
    `assistant`, <|channel|>, `commentary to=functions.f `, <|constrain|>, `json`: the channel is
    the word after a <|channel|> marker, the recipient a `to=` word anywhere (either may be None)."""
    channel = recipient = None
    texts: list[list[str]] = [[]]   # the header's text between markers, each run joined below
    after_channel = [False]
    for is_marker, text in parts:
        if is_marker:
            texts.append([])
            after_channel.append(text == CHANNEL)
        else:
            texts[-1].append(text)
    for run, follows_channel in zip(texts, after_channel):
        for k, word in enumerate("".join(run).split()):
            if word.startswith("to="):
                recipient = recipient or word[len("to="):] or None
            elif follows_channel and k == 0 and channel is None:
                channel = word
    return channel, recipient


class HarmonySplitter:
    """Splits a harmony reply, given as text and markers in order, into thinking, answer and
    tool calls (given at the end). Markers come only from token ids (HarmonyReader), so text
    is text wherever it stands."""

    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names
        self._header: list[tuple[bool, str]] = []   # the header being read: (is a marker, text)
        self._kind: str | None = None   # the open message: thinking, content, call or hidden (None: in a header)
        self._call_name = ""
        self._call_parts: list[str] = []
        self._calls: list[ToolCall] = []
        self._messages = 0           # messages opened so far

    def feed(self, text: str) -> ReasoningDelta:
        """The thinking and answer that this text (no marker in it, whatever it spells) adds."""
        out = ReasoningDelta()
        if self._kind is None:
            if text:
                self._header.append((False, text))
        else:
            self._write(out, text)
        return out

    def mark(self, marker: str) -> ReasoningDelta:
        """What a marker token the model sampled makes certain."""
        out = ReasoningDelta()
        if self._kind is not None:
            if marker in _BODY_ENDS:
                self._close(out)
                if marker == START:
                    self._header = [(True, START)]
            else:   # a header's marker inside a body stays in it, as the model wrote it
                self._write(out, marker)
        elif marker == MESSAGE:
            self._open(self._header)
            self._header = []
        elif marker in (END, RETURN, CALL):   # a header that never opened a message is dropped
            if not self._never_harmony():     # (unless it is the text of a reply not in harmony)
                self._header = []
        else:
            self._header.append((True, marker))
        return out

    def finish(self) -> tuple[ReasoningDelta, list[ToolCall]]:
        """What is still held when the reply ends, and the reply's tool calls. A message cut
        short keeps what it has; an unfinished header is dropped, unless the reply never was
        harmony (no marker and no message at all): then its text is the answer."""
        out = ReasoningDelta()
        if self._kind is not None:
            self._close(out)
        elif self._never_harmony():
            out.content += "".join(text for _, text in self._header)
        self._header = []
        calls, self._calls = self._calls, []
        return out, calls

    def _never_harmony(self) -> bool:
        """Whether the reply so far is text with no marker and no message in it."""
        return self._messages == 0 and not any(is_marker for is_marker, _ in self._header)

    def _open(self, header: list[tuple[bool, str]]) -> None:
        """Start a message with this header."""
        self._messages += 1
        channel, recipient = header_fields(header)
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


class HarmonyReader:
    """One sample's reply, delta by delta, into the splitter: its tokens decoded here with each
    marker token apart, and passed on only as far as the deltas' own text has come (text that
    a stop string holds back waits; what it cuts off never comes)."""

    def __init__(self, tokens: HarmonyTokens, tool_names: set[str]):
        self.tokens = tokens
        self.splitter = HarmonySplitter(tool_names)
        self._decoder = IncrementalDecoder(tokens.tokenizer, skip_special=True)
        self._parts: deque[list] = deque()   # decoded and not yet passed on: [is a marker, text, length]
        self._credit = 0   # characters the deltas carried beyond what was passed on

    def feed(self, text: str | None, token_id: int | None, final: bool = False) -> ReasoningDelta:
        """What a delta (its text, None for all that is decoded; the token behind it; whether it
        is the sample's last) makes certain."""
        if token_id is not None:
            self._decode(token_id)
        if final:
            self._plain(self._decoder.flush())
        self._credit += sum(p[2] for p in self._parts) if text is None else len(text)
        out = ReasoningDelta()
        while self._parts:
            part = self._parts[0]
            is_marker, piece, length = part
            if length > self._credit:
                if is_marker or not self._credit:
                    break
                take = self._credit   # the part of a text that has come so far
                part[1], part[2] = piece[take:], length - take
                piece, length = piece[:take], take
            else:
                self._parts.popleft()
            self._credit -= length
            self._add(out, self.splitter.mark(piece) if is_marker else self.splitter.feed(piece))
        if self._credit and text and not self._parts:   # text with no token behind it (a beam's): plain
            self._add(out, self.splitter.feed(text[len(text) - min(self._credit, len(text)):]))
            self._credit = 0
        return out

    @staticmethod
    def _add(out: ReasoningDelta, part: ReasoningDelta) -> None:
        out.thinking, out.content = out.thinking + part.thinking, out.content + part.content

    def finish(self) -> tuple[ReasoningDelta, list[ToolCall]]:
        """The splitter's end (see HarmonySplitter.finish); text a stop string cut off is dropped."""
        self._parts.clear()
        return self.splitter.finish()

    def _decode(self, token_id: int) -> None:
        # as the deltas' text is made (api/text_stream.py): an end of generation adds no text
        tokenizer, marker = self.tokens.tokenizer, self.tokens.markers.get(token_id)
        piece = "" if token_id in tokenizer.eot_ids else self._decoder.add(token_id)
        if marker is None:
            self._plain(piece)
            return
        spelled = len(marker) if piece.endswith(marker) else 0   # a control copy decodes to nothing
        self._plain(piece[:len(piece) - spelled])
        self._parts.append([True, marker, spelled])

    def _plain(self, text: str) -> None:
        if text:
            self._parts.append([False, text, len(text)])


def split_harmony(ids: list[int], tokens: HarmonyTokens, tool_names: set[str]) -> tuple[str, str, list[ToolCall]]:
    """(thinking, answer, tool calls) of a whole harmony reply, from its token ids."""
    reader = HarmonyReader(tokens, tool_names)
    pieces = [reader.feed(None, t) for t in ids]
    pieces.append(reader.feed(None, None, final=True))
    last, calls = reader.finish()
    pieces.append(last)
    return "".join(p.thinking for p in pieces), "".join(p.content for p in pieces), calls
