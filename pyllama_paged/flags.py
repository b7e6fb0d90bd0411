"""Settings that are also command-line options. One helper declares such a dataclass field
(`flagged`: its flag, its help and argparse's settings beside the field, so that the CLI and
every message naming the option say the same); a field holding another settings dataclass
is a group of options (`group`). The parser is built from a settings object (`add_flags`:
its values are the options' defaults) and read back into a copy of it (`read_flags`)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Callable

from .errors import PagedError


def flagged(default, flag: str, help_text: str, *, show: Callable | None = None, **argparse_settings) -> Any:
    """A dataclass field that is also the option `flag`; argparse_settings: type, choices,
    action, nargs, const, metavar, aliases. show(value): the default as the help says it
    (None: left unsaid), where the option's text is not the field's value (a size, milliseconds)."""
    return dataclasses.field(default=default, metadata={"flag": flag, "help": help_text, "show": show,
                                                        **argparse_settings})


def group(settings: type, *, default=None, default_factory=None, build: Callable | None = None,
          switches: tuple[str, ...] = (), title: str | None = None) -> Any:
    """A field holding a settings dataclass (or None) whose flagged fields are options too. One
    that is None stays None unless one of its switches (field names) is given on the command
    line; build(values) makes it from its options' values (default: settings(**values)). title:
    the help's heading for its options."""
    meta = {"group": settings, "build": build, "switches": switches, "title": title}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(settings: type, name: str) -> str:
    """The option that sets field `name` of a settings class."""
    return next(f.metadata["flag"] for f in dataclasses.fields(settings) if f.name == name)


def _defaults(settings, switches: tuple[str, ...]) -> dict[str, Any]:
    """Each field's value in settings (an object), or for a class its default, None for its switches."""
    if not isinstance(settings, type):   # a field it resolves itself shows what it was given: its default
        resolved = getattr(settings, "RESOLVED_FIELDS", ())
        return {f.name: f.default if f.name in resolved else getattr(settings, f.name)
                for f in dataclasses.fields(settings)}
    return {f.name: None if f.name in switches else f.default if f.default is not dataclasses.MISSING
            else f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            for f in dataclasses.fields(settings)}


def add_flags(parser, settings, *, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
              _prefix: str = "", _switches: tuple[str, ...] = ()) -> None:
    """One option per flagged field of settings (a dataclass object: its values are the
    defaults), then its groups'; skip: fields left out (a group's as "group.field"), only:
    the fields kept (None: all)."""
    values = _defaults(settings, _switches)
    for f in dataclasses.fields(settings):
        if _prefix + f.name in skip or (only is not None and f.name not in only):
            continue
        if "group" in f.metadata:
            inner = values[f.name]
            sub = parser.add_argument_group(f.metadata["title"]) if f.metadata["title"] else parser
            add_flags(sub, inner if inner is not None else f.metadata["group"], skip=skip,
                      _prefix=f"{_prefix}{f.name}.", _switches=f.metadata["switches"] if inner is None else ())
        elif "flag" in f.metadata:
            _add_option(parser, f, values[f.name], _prefix + f.name)


def _add_option(parser, f: dataclasses.Field, default, dest: str) -> None:
    settings = {k: v for k, v in f.metadata.items() if k not in ("flag", "help", "aliases", "show")}
    flag, help_text = f.metadata["flag"], f.metadata["help"]
    show = f.metadata["show"]
    shown = show(default) if show is not None else default
    if settings.get("action") in (None, argparse.BooleanOptionalAction):
        if "choices" not in settings and "action" not in settings:   # named after the flag, as argparse does
            settings.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
        if shown is not None and help_text:
            help_text += f" (default {shown})"
    parser.add_argument(flag, *f.metadata.get("aliases", ()), dest=dest, default=default, help=help_text,
                        **settings)


def read_flags(settings, args: argparse.Namespace, *, skip: tuple[str, ...] = (),
               only: tuple[str, ...] | None = None):
    """A copy of settings with the value of every option add_flags made (the same skip and
    only) from args, the parsed command line; its groups made again (a group's own check
    failing is a PagedError naming its options)."""
    return dataclasses.replace(settings, **_read(settings, args, skip, only, ""))


def _read(settings, args: argparse.Namespace, skip: tuple[str, ...], only, prefix: str) -> dict[str, Any]:
    """The options' values of the fields of settings (a dataclass object or class)."""
    changes = {}
    for f in dataclasses.fields(settings):
        if prefix + f.name in skip or (only is not None and f.name not in only):
            continue
        if "group" in f.metadata:
            current = None if isinstance(settings, type) else getattr(settings, f.name)
            changes[f.name] = _read_group(f, current, args, skip, f"{prefix}{f.name}.")
        elif "flag" in f.metadata:
            changes[f.name] = getattr(args, prefix + f.name)
    return changes


def _read_group(f: dataclasses.Field, current, args: argparse.Namespace, skip: tuple[str, ...], prefix: str):
    cls, build, switches = f.metadata["group"], f.metadata["build"], f.metadata["switches"]
    if current is None and switches and all(getattr(args, prefix + s) is None for s in switches):
        return None   # off, and nothing on the command line turns it on
    values = _read(current if current is not None else cls, args, skip, None, prefix)
    if current is not None:   # made again from what it was given: the fields it resolves itself anew
        resolved = getattr(cls, "RESOLVED_FIELDS", ())
        values = {**{g.name: getattr(current, g.name) for g in dataclasses.fields(cls)
                     if g.init and g.name not in resolved}, **values}
    try:
        return build(values) if build is not None else cls(**values)
    except (PagedError, ValueError) as e:
        options = " / ".join(g.metadata["flag"] for g in dataclasses.fields(cls) if "flag" in g.metadata)
        raise PagedError(f"{options}: {e}") from None


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _amount(text: str) -> tuple[float, int] | None:
    """(number, unit's bytes; 0 without a unit) of an option's size, None where it is none."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or (unit and unit not in _UNITS) or (not unit and "." in m.group(1)):
        return None
    return float(m.group(1)), _UNITS.get(unit, 0)


def tokens_or_bytes(text: str) -> tuple[int | None, int | None]:
    """--kv-budget: (tokens, None) for a plain number, (None, bytes) for a size with a unit
    (512MiB, 1.5GiB, 84MB); ArgumentTypeError for anything else or for less than 1."""
    amount = _amount(text)
    if amount is None:
        raise argparse.ArgumentTypeError(f"'{text}' is neither a number of tokens nor a size like 512MiB "
                                         f"(units: {', '.join(_UNITS)})")
    value, unit = amount
    if int(value * (unit or 1)) < 1:
        raise argparse.ArgumentTypeError(f"the KV budget must be at least 1 {'byte' if unit else 'token'}")
    return (None, int(value * unit)) if unit else (int(value), None)


def size_bytes(text: str) -> int:
    """A size option (--replica-memory, --prefix-cache-disk): with a unit (2GiB) or a number of
    bytes; ArgumentTypeError for anything else or for less than 1."""
    amount = _amount(text)
    if amount is None or int(amount[0] * (amount[1] or 1)) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size such as 16GiB (units: {', '.join(_UNITS)})")
    return int(amount[0] * (amount[1] or 1))


def at_least_zero(text: str, kind: type, what: str, unit: str = ""):
    """An option's number (kind: int or float) >= 0; ArgumentTypeError saying what it must be."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not {what}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0{unit}, got {text}")
    return value


def mebibytes(text: str) -> int:
    """An option in MiB (>= 0) as bytes."""
    return at_least_zero(text, int, "a number of MiB", " MiB") << 20


def show_size(value: int) -> str:
    """A byte count as an option says it (16GiB, 512MiB, or bytes)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if value % scale == 0:
            return f"{value // scale}{unit}"
    return str(value)
