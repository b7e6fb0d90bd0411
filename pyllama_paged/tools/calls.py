"""Tool calls found in generated text, for the template families we ship:
Qwen/Hermes (<tool_call>{json}</tool_call>; Qwen3.5's XML function in the same block),
Llama 3.x ({"name", "parameters"},
after <|python_tag|> or bare), Mistral ([TOOL_CALLS] [{"name", "arguments"}]),
Gemma-style bare JSON (also inside a ``` fence), Gemma's tool_code fence of
Python calls (```tool_code\nget_weather(city="Paris")\n```), and Gemma 4's
<|tool_call>call:NAME{...}<tool_call|> (gemma4.py)."""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field

from .call_scan import SEPARATORS as _SEPARATORS
from .call_scan import CallScan, Options
from .gemma4 import CALL_OPEN, parse_gemma4_calls

# Scanning is done with str.find/strip and slices, never with a regex holding a
# lazy body between whitespace runs: a model (or a user's grammar) can write "```"
# and thousands of spaces, and such a regex backtracks in cubic time on it.
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_FENCE_LANG = re.compile(r"[a-zA-Z_]*")   # one greedy run: linear, nothing to backtrack into
_BETWEEN_CALLS = re.compile(r"[ \n\t;,]*")
_JSON_NAMES = {"true": True, "false": False, "null": None}
# what a call object may hold (call_scan.py reads the same while it streams): another key
# makes the object an answer in JSON, not a call
_CALL_KEYS = frozenset(("name", "arguments", "parameters", "type", "function", "id"))
_FUNCTION_KEYS = frozenset(("name", "arguments", "parameters", "description"))
# openings of a call that may follow answer text (Hermes', Gemma 4's)
_MID_OPENERS = (_OPEN, CALL_OPEN)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        """OpenAI's shape: arguments as a JSON string."""
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}
        return out if index is None else {"index": index, **out}

    def ollama(self) -> dict:
        """Ollama's shape: arguments as an object."""
        return {"function": {"name": self.name, "arguments": self.arguments}}


def _as_call(obj, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not obj.keys() <= _CALL_KEYS:
        return None
    if isinstance(obj.get("function"), dict):   # {"type": "function", "function": {...}}
        obj = obj["function"]
        if not obj.keys() <= _FUNCTION_KEYS:
            return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not isinstance(args, dict) or (names and name not in names):
        return None
    return ToolCall(name, args)


def _xml_value(text: str):
    """A parameter's value: what it reads as in JSON unless that is a string (a number, a
    boolean, null, an object, an array), else the text itself (the tool's schema is not
    consulted: a string parameter of digits comes back as a number)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return text if isinstance(value, str) else value


def _calls_in_xml(body: str, names: set[str]) -> list[ToolCall] | None:
    """Qwen3.5's (and Qwen3-Coder's) call in a <tool_call> block: <function=NAME>, then
    <parameter=KEY> value </parameter> for each argument (the value on its own lines), then
    </function>; None for anything else."""
    whole = _XML_FUNCTION.fullmatch(body)
    if whole is None:
        return None
    name, inner, args, pos = whole.group(1).strip(), whole.group(2), {}, 0
    for param in _XML_PARAMETER.finditer(inner):
        if inner[pos:param.start()].strip():
            return None
        args[param.group(1).strip()] = _xml_value(param.group(2))
        pos = param.end()
    if inner[pos:].strip() or not name or (names and name not in names):
        return None
    return [ToolCall(name, args)]


def _hermes_blocks(text: str) -> list[tuple[int, int, str]]:
    """(start, end, stripped body) of each <tool_call> block; an unclosed one runs to the end."""
    blocks, pos = [], 0
    while (start := text.find(_OPEN, pos)) != -1:
        body = start + len(_OPEN)
        close = text.find(_CLOSE, body)
        stop, end = (len(text), len(text)) if close == -1 else (close, close + len(_CLOSE))
        blocks.append((start, end, text[body:stop].strip()))
        pos = end
    return blocks


def _fenced_body(text: str, lang: str | None = None) -> str | None:
    """The stripped body of a whole-text ``` fence (with the given language tag, or any
    ASCII one), or None when the text is not one fence."""
    if not text.startswith("```") or not text.endswith("```"):
        return None
    head = 3 + len(lang) if lang is not None else _FENCE_LANG.match(text, 3).end()
    if lang is not None and text[3:head] != lang:
        return None
    if len(text) - 3 < head:   # the opening and closing fences overlap
        return None
    return text[head:len(text) - 3].strip()


def _calls_in_json(text: str, names: set[str]) -> list[ToolCall] | None:
    text = text.strip()
    fenced = _fenced_body(text)
    if fenced is not None:
        text = fenced
    for marker in ("[TOOL_CALLS]", "<|python_tag|>"):
        text = text.removeprefix(marker).strip()
    try:
        value = json.loads(text)
    except RecursionError:
        return None   # nested deeper than the decoder goes: no call of ours looks like that
    except ValueError:   # JSONDecodeError, or an integer too long to convert
        # several JSON objects one after another (Llama 3.x may separate them with ';')
        value, decoder, pos = [], json.JSONDecoder(), 0
        try:
            while pos < len(text):
                obj, end = decoder.raw_decode(text, pos)
                value.append(obj)
                pos = _BETWEEN_CALLS.match(text, end).end()
        except (ValueError, RecursionError):
            return None
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(v, names) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls


def _literal(node: ast.expr):
    """A keyword argument's value: a Python literal, or JSON's true/false/null."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    return ast.literal_eval(node)


def _calls_in_python(text: str, names: set[str]) -> list[ToolCall] | None:
    """Gemma's tool_code: one call per line (print(...) around it allowed), keyword
    arguments with literal values. Parsed, never run."""
    try:
        tree = ast.parse(text, mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    calls = []
    for statement in tree.body:
        node = statement.value if isinstance(statement, ast.Expr) else None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
                and len(node.args) == 1 and not node.keywords):
            node = node.args[0]
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            return None   # positional or **arguments cannot be named without running anything
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        try:
            arguments = {k.arg: _literal(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        if name is None or (names and name not in names):
            return None
        calls.append(ToolCall(name, arguments))
    return calls or None


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content left, tool calls) of a whole answer; names, when given, are the only
    functions a call may name (anything else stays content)."""
    names = names or set()
    if CALL_OPEN in text:
        found = parse_gemma4_calls(text, names)
        return (found[0], [ToolCall(name, args) for name, args in found[1]]) if found is not None else (text, [])
    if _OPEN in text:
        calls, kept, pos = [], [], 0
        for start, end, body in _hermes_blocks(text):
            found = _calls_in_xml(body, names) if body.startswith("<function=") else _calls_in_json(body, names)
            if found is None:
                return text, []
            calls += found
            kept.append(text[pos:start])
            pos = end
        kept.append(text[pos:])
        return "".join(kept).strip(), calls
    found = _calls_in_json(text, names)
    if found:
        return "", found
    tool_code = _fenced_body(text.strip(), "tool_code")
    found = _calls_in_python(tool_code, names) if tool_code is not None else None
    if found:
        return "", found
    return text, []


class ToolCallStream:
    """Streams content while it cannot be a tool call; holds back text that may be one (it
    opens like one: `{`, `[`, a fence, a call marker, or `<tool_call>` anywhere) only until
    call_scan tells it cannot be, then lets it through. Whole calls followed by text that is
    no call end the answer: `done`, the calls kept and that text dropped (`dropped` characters),
    so the generation can stop there."""

    def __init__(self, names: set[str]):
        self.names = names
        self._options = Options(names) if names else None
        self.started = False   # some non-space content was let through: only <tool_call> opens a call now
        self.done = False
        self.dropped = 0
        # Pieces kept as lists, joined when needed: growing one string piece by piece copies
        # it every time (quadratic over a long answer).
        self._space: list[str] = []   # leading whitespace, before anything else came
        self._tail = ""               # (started) what may be the start of "<tool_call>"
        self._parts: list[str] = []   # the held candidate
        self._scan: CallScan | None = None

    def feed(self, text: str) -> str:
        """Content safe to stream now."""
        if self.done or not text:
            return ""
        if self._scan is not None:
            return self._hold(text)
        if not self.started:
            self._space.append(text)
            if text.isspace():
                return ""
            text, self._space = "".join(self._space), []
            if text.lstrip()[0] in "<[{`":
                return self._begin(text, hermes_only=False)
            self.started = True
        return self._stream(text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still held, tool calls) at the end of the answer."""
        if not self._parts:
            text = "".join(self._space) + self._tail
            self._space, self._tail = [], ""
            return text, []
        complete = self._scan.complete_end if self._scan is not None else None
        text, self._parts, self._scan = "".join(self._parts), [], None
        content, calls = parse_tool_calls(text, self.names)
        if not calls and complete is not None:   # whole calls, then one cut short: the whole ones
            content, calls = parse_tool_calls(text[:complete], self.names)
        return content, calls

    def _stream(self, text: str) -> str:
        """Content once some has been let through: all but a <tool_call> (or Gemma 4's
        <|tool_call>) block (held)."""
        text, self._tail = self._tail + text, ""
        found = min((at for opener in _MID_OPENERS if (at := text.find(opener)) >= 0), default=-1)
        if found >= 0:
            return text[:found] + self._begin(text[found:], hermes_only=True)
        # what may begin an opener waits: it starts at the last "<" (each opener holds one, first)
        last = text.rfind("<", max(0, len(text) - max(map(len, _MID_OPENERS)) + 1))
        cut = last if last >= 0 and any(o.startswith(text[last:]) for o in _MID_OPENERS) else len(text)
        self._tail = text[cut:]
        return text[:cut]

    def _begin(self, text: str, hermes_only: bool) -> str:
        self._parts = []
        self._scan = CallScan(self._options, self._parses, hermes_only)
        return self._hold(text)

    def _hold(self, text: str) -> str:
        self._parts.append(text)
        if self._scan.feed(text):
            return ""
        held, complete, self._scan = "".join(self._parts), self._scan.complete_end, None
        if complete is not None:   # whole calls, then text that is none: the answer ends with them
            self._parts, self.done, self.dropped = [held[:complete]], True, len(held) - complete
            return ""
        # no call: let it through, up to its first character; the rest may still hold a <tool_call>
        self._parts, self.started = [], True
        first = len(held) - len(held.lstrip()) + 1
        return held[:first] + self._stream(held[first:])

    def _parses(self, text: str) -> bool:
        """Whether text (from the held candidate's start or its last whole call on) is tool
        calls and nothing else."""
        content, calls = parse_tool_calls(text.lstrip(_SEPARATORS), self.names)
        return bool(calls) and not content.strip()
