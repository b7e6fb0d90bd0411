"""Where a chat template runs: a bounded Jinja sandbox, and the renderer process's main loop.

A GGUF's chat template is code from whoever published the model. It renders inside
Jinja's immutable sandbox (no attribute or method that changes anything, no underscore
names), here narrowed further: operations that build a huge value in one step (a string
or list repeated, a number multiplied or raised to a huge size, text padded, formatted or
replaced to a huge width) are refused before they run, since one such step is a single C
call that nothing in the same process can interrupt. That is the first line; the guarantee
is the process: `render_pool` runs this file as a script in renderer processes with an
address-space and CPU limit and kills one that overruns its wall-clock budget.

This module imports nothing from pyllama_paged (only the standard library and Jinja), so a
renderer process starts without the package's native library: run as a script, it reads
jobs (the template source and the render's variables, pickled by the server) from stdin
and writes each result to stdout as one frame: a kind byte and UTF-8 text.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import re
import string
import struct
import sys
from collections import OrderedDict
from typing import Any

import jinja2
import jinja2.filters
import jinja2.nodes
import jinja2.sandbox

# One operation may not build a string or list longer than this many items (a prompt is
# at most a few million characters), nor a number wider than MAX_INT_BITS, nor pad or
# indent by more than MAX_WIDTH characters.
MAX_PRODUCT_ITEMS = 1 << 22
MAX_INT_BITS = 1 << 16
MAX_WIDTH = 1 << 16
# a template's source (real ones are tens of KiB): the server parses it when the model loads
MAX_SOURCE_CHARS = 1 << 20
# templates a renderer process keeps compiled (a server has a few models)
CACHED_TEMPLATES = 32

# reply kinds: the text, or why there is none
OK, RAISED, REFUSED, FAILED, OUT_OF_MEMORY, TOO_BIG = b"o", b"r", b"s", b"f", b"m", b"b"
_FRAME = struct.Struct("<Q")
# a %-conversion's flags, width and precision (each a number or '*')
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_NUMBER = re.compile(r"\d+")


class TemplateRaised(Exception):
    """The template called raise_exception(message): the model's own refusal of the input."""


def _refuse(why: str) -> None:
    raise jinja2.sandbox.SecurityError(why)


def _check_width(width: Any, what: str) -> None:
    if isinstance(width, int) and width > MAX_WIDTH:
        _refuse(f"the template {what} to a width of {width} (at most {MAX_WIDTH})")


def _check_percent(fmt: str, args: Any) -> None:
    """Refuse a %-format whose width or precision (written, or taken from args by '*') is huge."""
    stars = []
    for match in _PERCENT_SPEC.finditer(fmt):
        for part in match.groups():
            if part == "*":
                stars.append(True)
            elif part is not None and (len(part) > 6 or int(part) > MAX_WIDTH):
                _refuse(f"the template formats to a width of {part} (at most {MAX_WIDTH})")
    if stars:
        values = args if isinstance(args, tuple) else (args,)
        for value in values:
            _check_width(value, "formats")


def _check_format_spec(fmt: str) -> None:
    """Refuse a str.format string whose fields ask for a huge or computed width."""
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if not spec:
            continue
        if "{" in spec:
            _refuse("the template formats with a computed width")
        for number in _NUMBER.findall(spec):
            if len(number) > 6 or int(number) > MAX_WIDTH:
                _refuse(f"the template formats to a width of {number} (at most {MAX_WIDTH})")


def _check_replace(text: str, old: Any, new: Any, count: Any = -1) -> None:
    if not (isinstance(old, str) and isinstance(new, str)) or len(new) <= len(old):
        return
    hits = len(text) + 1 if old == "" else text.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    if len(text) + hits * (len(new) - len(old)) > MAX_PRODUCT_ITEMS:
        _refuse(f"the template replaces text into more than {MAX_PRODUCT_ITEMS} characters")


def _check_join(separator: Any, items: Any) -> None:
    if isinstance(separator, str) and hasattr(items, "__len__") \
            and len(separator) * max(len(items) - 1, 0) > MAX_PRODUCT_ITEMS:
        _refuse(f"the template joins {len(items)} items with a separator of {len(separator)} characters")


def _check_product(left: Any, right: Any) -> None:
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int) \
                and len(seq) * max(count, 0) > MAX_PRODUCT_ITEMS:
            _refuse(f"the template repeats a sequence {count} times")
    if isinstance(left, int) and isinstance(right, int) \
            and abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
        _refuse("the template multiplies numbers into one of more than "
                f"{MAX_INT_BITS} bits")


def _check_power(left: Any, right: Any) -> None:
    if isinstance(right, int) and isinstance(left, int) and abs(left) > 1 \
            and right * max(abs(left).bit_length(), 1) > MAX_INT_BITS:
        _refuse("the template raises a number to an enormous power")


# str methods that can make a huge string from a small one, and the check of their arguments
_STR_METHODS = {
    "center": lambda s, width=0, *_: _check_width(width, "pads text"),
    "ljust": lambda s, width=0, *_: _check_width(width, "pads text"),
    "rjust": lambda s, width=0, *_: _check_width(width, "pads text"),
    "zfill": lambda s, width=0, *_: _check_width(width, "pads text"),
    "expandtabs": lambda s, tabsize=8, *_: _check_width(tabsize, "expands tabs"),
    "replace": _check_replace,
    "join": lambda s, items=(), *_: _check_join(s, items),
}


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, refusing operations that would build a huge value in one
    C call (which no time budget in the process can interrupt)."""

    intercepted_binops = frozenset(["*", "**", "%"])

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        """`*`, `**` and `%` from the template, refused when their result would be huge."""
        if operator == "*":
            _check_product(left, right)
        elif operator == "**":
            _check_power(left, right)
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's names)
        """A call from the template, its str padding/replacing methods bounded first."""
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            check = _STR_METHODS.get(getattr(__obj, "__name__", ""))
            if check is not None:
                check(owner, *args, *kwargs.values())
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any):
        """str.format / format_map from the template, with their widths bounded."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        _check_format_spec(value.__self__)
        return wrapped


def _bounded_filter(name: str, check):
    base = jinja2.filters.FILTERS[name]

    def bounded(*args: Any, **kwargs: Any) -> Any:
        # pass_eval_context filters take the context first; the checks look past it
        plain = args[1:] if isinstance(args[0], jinja2.nodes.EvalContext) else args
        check(*plain, **kwargs)
        return base(*args, **kwargs)

    if hasattr(base, "jinja_pass_arg"):   # how Jinja knows to pass the eval context first
        bounded.jinja_pass_arg = base.jinja_pass_arg
    bounded.__name__ = base.__name__
    return bounded


def _check_center(value: Any, width: Any = 80) -> None:
    _check_width(width, "pads text")


def _check_indent(value: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    columns = width if isinstance(width, int) else len(str(width))
    _check_width(columns, "indents text")
    if (str(value).count("\n") + 1) * max(columns, 0) > MAX_PRODUCT_ITEMS:
        _refuse(f"the template indents text into more than {MAX_PRODUCT_ITEMS} characters")


def _check_join_filter(value: Any, d: Any = "", attribute: Any = None) -> None:
    _check_join(d, value)


def _check_format_filter(value: Any, *args: Any, **kwargs: Any) -> None:
    _check_percent(str(value), kwargs or tuple(args))


def _check_replace_filter(value: Any, old: Any = "", new: Any = "", count: Any = None, **_: Any) -> None:
    _check_replace(str(value), old, new, -1 if count is None else count)


def _check_tojson(value: Any, indent: Any = None) -> None:
    _check_width(indent, "indents JSON")


@jinja2.pass_eval_context
def _plain_tojson(eval_ctx, value: Any, indent: int | None = None) -> str:
    """Jinja's tojson as a plain string: its Markup would HTML-escape the markup it is added to
    (gpt-oss's template writes `"...<|message|>" + content|tojson + "<|end|>"`)."""
    _check_tojson(value, indent)
    return str(jinja2.filters.do_tojson(eval_ctx, value, indent))


def _raise(message: Any) -> None:
    raise TemplateRaised(str(message))


def environment() -> BoundedSandbox:
    """The Jinja environment every chat template renders in (in a renderer process or not)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    # transformers' helper, which gpt-oss's template calls for the date in its system message
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(str(fmt))
    env.globals.pop("lipsum", None)   # paragraphs of filler text on demand: no chat needs them
    env.filters["tojson"] = _plain_tojson
    for name, check in (("center", _check_center), ("indent", _check_indent), ("format", _check_format_filter),
                        ("replace", _check_replace_filter), ("join", _check_join_filter)):
        env.filters[name] = _bounded_filter(name, check)
    return env


def check_syntax(source: str) -> None:
    """jinja2.TemplateSyntaxError unless source parses. Parsing only: compiling folds constant
    expressions (`{{ 'x'|center(10**9) }}` would run at compile time), so compiling a template
    is left to the renderer process."""
    if len(source) > MAX_SOURCE_CHARS:
        raise jinja2.TemplateSyntaxError(f"the template has {len(source)} characters, more than the "
                                         f"{MAX_SOURCE_CHARS} a chat template may have", 1)
    try:
        environment().parse(source)
    except RecursionError:
        raise jinja2.TemplateSyntaxError("the template is nested too deeply", 1) from None


# ---- the renderer process -------------------------------------------------------------
def render(env: BoundedSandbox, cache: OrderedDict, source: str, variables: dict) -> tuple[bytes, str]:
    """(reply kind, text) of one render: the prompt, or why there is none."""
    try:
        template = cache.get(source)
        if template is None:
            template = cache[source] = env.from_string(source)
            while len(cache) > CACHED_TEMPLATES:
                cache.popitem(last=False)
        cache.move_to_end(source)
        return OK, template.render(**variables)
    except MemoryError:
        return OUT_OF_MEMORY, "ran out of memory"
    except TemplateRaised as e:
        return RAISED, str(e)
    except jinja2.sandbox.SecurityError as e:
        return REFUSED, str(e)
    except jinja2.TemplateError as e:
        return FAILED, str(e)
    except RecursionError:
        return FAILED, "it recurses too deeply"
    except Exception as e:   # the template's own error (a TypeError of its expressions, ...)
        return FAILED, f"{type(e).__name__}: {e}"


def read_frame(fd: int) -> bytes | None:
    """One length-prefixed frame from fd (None at end of input)."""
    head = _read_exactly(fd, _FRAME.size)
    if head is None:
        return None
    return _read_exactly(fd, _FRAME.unpack(head)[0])


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def write_frame(fd: int, payload: bytes) -> None:
    """payload to fd as one length-prefixed frame."""
    view = memoryview(_FRAME.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


def _cpu_budget(seconds: float) -> None:
    """Let this process use seconds more of CPU from now (SIGXCPU ends it past that): the
    backstop for a render the server could not stop (it died or hung itself)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _limit_memory(limit_bytes: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # a renderer ended by a limit leaves no core file
    if limit_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def serve(read_fd: int, write_fd: int, max_output_bytes: int) -> int:
    """Render jobs from read_fd until it closes; each job is (source, variables, cpu seconds)."""
    env, cache = environment(), OrderedDict()
    while True:
        job = read_frame(read_fd)
        if job is None:
            return 0
        source, variables, cpu_seconds = pickle.loads(job)
        _cpu_budget(cpu_seconds)
        kind, text = render(env, cache, source, variables)
        try:
            payload = text.encode("utf-8", "surrogatepass")
            if len(payload) > max_output_bytes:
                kind, payload = TOO_BIG, str(len(payload)).encode()
            write_frame(write_fd, kind + payload)
        except MemoryError:
            write_frame(write_fd, OUT_OF_MEMORY + b"ran out of memory")
        if kind == OUT_OF_MEMORY:
            return 1   # its heap may be left fragmented: the server starts a fresh one


def main(argv: list[str]) -> int:
    """The renderer process: argv is [memory limit in bytes, the most bytes a prompt may have]."""
    memory_bytes, max_output_bytes = int(argv[0]), int(argv[1])
    write_fd = os.dup(1)
    os.dup2(2, 1)   # a stray print goes to stderr, never into the replies
    _limit_memory(memory_bytes)
    return serve(0, write_fd, max_output_bytes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
