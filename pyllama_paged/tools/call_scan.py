"""Whether a streamed answer can still be a tool call, read one character at a time.

An answer held back because it opens like a call (`{`, `[`, a fence, `<tool_call>`...) is
fed here as it streams. Each call format we parse (calls.py) is a small recognizer written as
a generator that receives one character per step and gives up (NotACall) at the first one that
no call of the request's tools could have: a key a call object never has, a function name
that is not a prefix of a tool's, text after a fence's language that is not JSON. Every
recognizer dead means the held text is plain content and can be let through at once. A call
that closes (its JSON object, `</tool_call>`, the fence) is checked by the parser itself and
marked complete; what follows may be another call of the same format, and anything else
(text after the call) ends the answer there.

Argument values are only followed as JSON structure (strings, brackets), not validated: the
parser has the last word when the call closes.
"""

from __future__ import annotations

from typing import Callable, Generator

SPACE = " \t\n\r"
SEPARATORS = SPACE + ";,"      # between bare JSON calls (Llama 3.x writes ';')
_CALL_KEYS = frozenset(("name", "arguments", "parameters", "type", "function", "id"))
_FUNCTION_KEYS = frozenset(("name", "arguments", "parameters", "description"))
_SCALAR_START = "-0123456789tfn"
_SCALAR_END = SPACE + ",}]"
_MAX_CHECKED = 256      # a key or a name longer than this is none of ours
_MAX_DEPTH = 256        # arguments nested deeper are not a call we read

Recognizer = Generator[None, str, None]


class NotACall(Exception):
    """The characters so far cannot be (the rest of) a tool call."""


class CallScan:
    """A held candidate's characters against every call format it may open; `complete_end`
    is the length of the text that held whole calls when the last one closed."""

    def __init__(self, names: Options | None, verify: Callable[[str], bool], hermes_only: bool = False):
        self.names = names   # the tools' names (None: any name)
        self.verify = verify       # verify(text): whether the text after the last whole call parses as calls
        self.pos = 0               # characters fed
        self.complete_end: int | None = None
        self._since: list[str] = []   # the characters since the last whole call
        # after answer text, only the formats whose calls may follow it (Hermes', Gemma 4's)
        formats = (hermes, gemma4) if hermes_only else (hermes, gemma4, python_tag, mistral, bare_json, fence)
        self._live: list[Recognizer] = []
        for fmt in formats:
            recognizer = fmt(self)
            next(recognizer)   # to its first `yield`
            self._live.append(recognizer)

    def feed(self, text: str) -> bool:
        """Feed characters; False once no format can go on (then `complete_end` says whether
        whole calls came before)."""
        since = self._since
        for k, ch in enumerate(text):
            if len(self._live) != 1:
                if not self._live:
                    return False
                since.append(ch)
                self._live = [r for r in self._live if _sends(r, ch)]
                self.pos += 1
                continue
            # the usual case once the format is known: one recognizer, the rest of the text to it
            recognizer = self._live[0]
            try:
                for ch in text[k:]:
                    since.append(ch)
                    recognizer.send(ch)
                    self.pos += 1
            except (NotACall, StopIteration):
                self._live = []
                self.pos += 1
            break
        return bool(self._live)

    def mark_complete(self) -> None:
        """A recognizer has read a call's last character (the one fed now)."""
        if not self.verify("".join(self._since)):   # each call's text once: linear in the answer
            raise NotACall
        self.complete_end = self.pos + 1
        self._since.clear()


def _sends(recognizer: Recognizer, ch: str) -> bool:
    try:
        recognizer.send(ch)
        return True
    except (NotACall, StopIteration):
        return False


# -- pieces of the formats: each `ch = yield` takes the next character ------------------------

def _literal(word: str, ch: str):
    """The literal word, its first character already read as ch."""
    for k, expected in enumerate(word):
        if k:
            ch = yield
        if ch != expected:
            raise NotACall


def _next_solid(ch: str | None = None):
    """The first character that is not whitespace, from ch (None: from the next one)."""
    if ch is None:
        ch = yield
    while ch in SPACE:
        ch = yield
    return ch


class Options:
    """The strings a key or a name may be, with every prefix of them (checked per character)."""

    def __init__(self, options):
        self.whole = frozenset(options)
        self.prefixes = frozenset(o[:k] for o in self.whole for k in range(len(o) + 1))


CALL_KEYS, FUNCTION_KEYS = Options(_CALL_KEYS), Options(_FUNCTION_KEYS)
_FUNCTION = Options(("function",))


def _string(options: Options | None = None):
    """The rest of a JSON string (its opening quote read), returned when options are given: a
    key or a name, which must be one of them (and has no escapes)."""
    if options is None:
        while (ch := (yield)) != '"':
            if ch == "\\":
                yield   # the escaped character (a \u's four digits are plain characters)
        return None
    text = ""
    while (ch := (yield)) != '"':
        text += ch   # short: more than _MAX_CHECKED characters is none of ours
        if ch == "\\" or len(text) > _MAX_CHECKED or text not in options.prefixes:
            raise NotACall
    if text not in options.whole:
        raise NotACall
    return text


def _free_value(ch: str):
    """Any JSON value from its first character ch, followed for its extent only; returns the
    character after a scalar (read to find its end), None otherwise."""
    if ch == '"':
        yield from _string()
        return None
    if ch in "{[":
        depth, in_string = 1, False
        while depth:
            ch = yield
            if in_string:
                if ch == "\\":
                    yield
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
                if depth > _MAX_DEPTH:
                    raise NotACall
            elif ch in "}]":
                depth -= 1
        return None
    if ch not in _SCALAR_START:
        raise NotACall
    while ch not in _SCALAR_END:
        ch = yield
    return ch


def _member(scan: CallScan, key: str, ch: str, in_function: bool):
    """A call object's value for key, from its first character ch; as _free_value returns."""
    if key in ("arguments", "parameters", "description"):
        if ch not in '{"':
            raise NotACall
        return (yield from _free_value(ch))
    if key == "function" and not in_function:
        if ch != "{":
            raise NotACall
        yield from _call_object(scan, in_function=True)
        return None
    if ch != '"':
        raise NotACall
    yield from _string(scan.names if key == "name" else _FUNCTION if key == "type" else None)
    return None


def _call_object(scan: CallScan, in_function: bool = False):
    """The rest of a call object (its `{` read): keys a call has, a name of one of the tools."""
    keys = FUNCTION_KEYS if in_function else CALL_KEYS
    ch = yield from _next_solid()
    if ch == "}":
        raise NotACall   # {} calls nothing
    while True:
        if ch != '"':
            raise NotACall
        key = yield from _string(keys)
        if (yield from _next_solid()) != ":":
            raise NotACall
        after = yield from _member(scan, key, (yield from _next_solid()), in_function)
        ch = yield from _next_solid(after)
        if ch == "}":
            return
        if ch != ",":
            raise NotACall
        ch = yield from _next_solid()


def _calls_value(scan: CallScan, ch: str):
    """A call object or an array of them, from its first character ch."""
    if ch == "{":
        yield from _call_object(scan)
        return
    if ch != "[":
        raise NotACall
    ch = yield from _next_solid()
    while True:
        if ch != "{":
            raise NotACall   # [] or an array of anything else calls nothing
        yield from _call_object(scan)
        ch = yield from _next_solid()
        if ch == "]":
            return
        if ch != ",":
            raise NotACall
        ch = yield from _next_solid()


def _json_calls(scan: CallScan, ch: str, end: str | None = None):
    """One or more JSON calls from ch, separated as Llama 3.x separates them; with end (a
    fence's close), the calls must be followed by it."""
    while True:
        yield from _calls_value(scan, ch)
        if end is None:
            scan.mark_complete()
        ch = yield
        while ch in SEPARATORS:
            ch = yield
        if end is not None and ch == end[0]:
            yield from _literal(end, ch)
            scan.mark_complete()
            yield from _next_solid()
            raise NotACall   # a fence holds the whole answer: anything after it is not a call


# -- the formats ---------------------------------------------------------------------------------

def hermes(scan: CallScan):
    """Qwen/Hermes: <tool_call> JSON </tool_call>, one block after another; Qwen3.5's (and
    Qwen3-Coder's) blocks hold an XML function instead of JSON."""
    ch = yield from _next_solid()
    while True:
        yield from _literal("<tool_call>", ch)
        ch = yield from _next_solid()
        if ch == "<":
            yield from _xml_function(scan, ch)
        else:
            yield from _calls_value(scan, ch)
            yield from _literal("</tool_call>", (yield from _next_solid()))
        scan.mark_complete()
        ch = yield from _next_solid()


def _xml_function(scan: CallScan, ch: str):
    """<function=NAME> its parameters </function> </tool_call>, its first character read as
    ch: the name a prefix of a tool's, the rest read through to </tool_call> (the parser
    checks the parameters when the block closes)."""
    yield from _literal("<function=", ch)
    name: list[str] = []
    while (ch := (yield)) != ">":
        name.append(ch)
        text = "".join(name)
        if ch == "\n" or len(text) > _MAX_CHECKED or (scan.names is not None and text not in scan.names.prefixes):
            raise NotACall
    end, seen = "</tool_call>", ""
    while not seen.endswith(end):
        seen = (seen + (yield))[-len(end):]


def python_tag(scan: CallScan):
    """Llama 3.x after its tag: <|python_tag|> JSON calls."""
    yield from _literal("<|python_tag|>", (yield from _next_solid()))
    yield from _json_calls(scan, (yield from _next_solid()))


def mistral(scan: CallScan):
    """Mistral: [TOOL_CALLS] [JSON calls]."""
    yield from _literal("[TOOL_CALLS]", (yield from _next_solid()))
    yield from _json_calls(scan, (yield from _next_solid()))


def bare_json(scan: CallScan):
    """Llama 3.x and Gemma-style bare JSON calls."""
    yield from _json_calls(scan, (yield from _next_solid()))


def fence(scan: CallScan):
    """A ``` fence of JSON calls (any language tag), or of Gemma's tool_code."""
    yield from _literal("```", (yield from _next_solid()))
    tag: list[str] = []
    ch = yield
    while ch.isascii() and (ch.isalpha() or ch == "_"):
        tag.append(ch)
        ch = yield
    if "".join(tag) != "tool_code":
        yield from _json_calls(scan, (yield from _next_solid(ch)), end="```")
        return
    ticks = 0
    while ticks < 3:   # Python calls: read by the parser once the fence closes
        ch = yield
        ticks = ticks + 1 if ch == "`" else 0
    scan.mark_complete()
    yield from _next_solid()
    raise NotACall   # a fence holds the whole answer: anything after it is not a call


# Gemma 4's markup (tools/gemma4.py holds the parser; the scan needs only the marks)
_GEMMA4_OPEN, _GEMMA4_CLOSE, _GEMMA4_QUOTE = "<|tool_call>call:", "<tool_call|>", '<|"|>'


def _gemma4_name(scan: CallScan):
    """A Gemma 4 call's function name, up to the `{` of its arguments (read)."""
    name = ""
    while (ch := (yield)) != "{":
        name += ch
        if len(name) > _MAX_CHECKED or (scan.names is not None and name not in scan.names.prefixes):
            raise NotACall
    if scan.names is not None and name not in scan.names.whole:
        raise NotACall


def _gemma4_arguments():
    """The rest of Gemma 4's argument object (its `{` read), followed for its extent only:
    brackets outside its `<|"|>` strings."""
    depth, in_string, recent = 1, False, ""
    while depth:
        ch = yield
        recent = (recent + ch)[-len(_GEMMA4_QUOTE):]
        if recent == _GEMMA4_QUOTE:
            in_string = not in_string
        elif not in_string and ch in "{[":
            depth += 1
            if depth > _MAX_DEPTH:
                raise NotACall
        elif not in_string and ch in "}]":
            depth -= 1


def gemma4(scan: CallScan):
    """Gemma 4: <|tool_call>call:NAME{arguments}<tool_call|>, one after another."""
    ch = yield from _next_solid()
    while True:
        yield from _literal(_GEMMA4_OPEN, ch)
        yield from _gemma4_name(scan)
        yield from _gemma4_arguments()
        yield from _literal(_GEMMA4_CLOSE, (yield))
        scan.mark_complete()
        ch = yield from _next_solid()
