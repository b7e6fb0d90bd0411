"""Grammars users give (JSON, JSON schema, regex, GBNF, Lark) compiled into a
Constraint, and each constrained sequence's matcher state."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from ..errors import RequestError
from ..tokenizer.tokenizer import Tokenizer
from .digits import DIGIT_BOUND, DigitRun, DigitTable, schema_digit_bound
from .vocab import digit_table, ll_tokenizer

KINDS = ("json", "json_schema", "regex", "gbnf", "lark")
# NOTE(constrain): compact JSON (no free whitespace between tokens): a small
# model given free whitespace can emit newlines until max_tokens and never
# close the object; the text still parses as the same JSON.
_JSON_OPTIONS = {"whitespace_flexible": False}


class ConstraintError(RequestError):
    """A grammar or schema that cannot be compiled (the request's fault: a 400)."""


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of a JSON schema whose objects with listed properties admit no others unless
    they say so (llama.cpp's reading of Ollama formats, and OpenAI's strict mode): left
    open, a small model keeps inventing keys until max_tokens."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed_objects(out[key])
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_schema_object(spec: Any) -> dict:
    """A JSON schema given as JSON text or a dict, as a dict; ConstraintError otherwise."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ConstraintError("the JSON schema must be an object")
    return spec


def _grammar(kind: str, spec: Any) -> str:
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json_schema":
        spec = json_schema_object(spec)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(spec), defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise ConstraintError(f"the JSON schema cannot be used: {e}") from None
    if not isinstance(spec, str) or not spec.strip():
        raise ConstraintError(f"a {kind} constraint must be a non-empty string")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    if kind == "gbnf":
        try:
            return llguidance.grammar_from("gbnf", spec)
        except ValueError as e:
            raise ConstraintError(f"the GBNF grammar does not parse: {e}") from None
    raise ConstraintError(f"unknown constraint kind {kind!r}; expected one of {', '.join(KINDS)}")


@dataclass(frozen=True)
class Constraint:
    """A compiled grammar for one vocabulary; start() gives each sequence its own matcher."""

    kind: str
    grammar: str
    tokenizer: llguidance.LLTokenizer
    # compiled once, by the caller's thread: each sample starts from a copy of it, so
    # the engine thread never compiles (n=8 compiled 9 times there)
    initial: Any = None
    digit_bound: int | None = None   # JSON: the longest run of digits outside strings (digits.py)
    digits: DigitTable | None = None

    def start(self) -> "ConstraintState":
        """A fresh matcher at the start of the grammar (a copy of the compiled one)."""
        if self.initial is None:
            matcher = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
        else:
            matcher = self.initial.deep_copy()
        run = DigitRun(self.digits, self.digit_bound) if self.digit_bound is not None and self.digits else None
        return ConstraintState(matcher, run)


def compile_constraint(tokenizer: Tokenizer, kind: str, spec: Any = None, digit_bound: int | None = None
                       ) -> Constraint:
    """Compile a grammar; ConstraintError (with the library's reason) when it is invalid. A JSON
    kind's numbers get at most digit_bound digits in a run (default: the schema's, see
    digits.py); another kind's only when digit_bound is given (a grammar around JSON)."""
    try:
        grammar = _grammar(kind, spec)
        if digit_bound is None and kind in ("json", "json_schema"):
            digit_bound = schema_digit_bound(spec) if kind == "json_schema" else DIGIT_BOUND
    except RecursionError:
        raise ConstraintError(f"the {kind.replace('_', ' ')} constraint is nested too deeply") from None
    ll = ll_tokenizer(tokenizer)
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"invalid {kind.replace('_', ' ')} constraint: {matcher.get_error()}")
    digits = digit_table(tokenizer) if digit_bound is not None else None
    return Constraint(kind, grammar, ll, matcher, digit_bound, digits)


class ConstraintState:
    """One sequence's position in its grammar (and, for JSON, in its runs of digits)."""

    __slots__ = ("matcher", "digits")

    def __init__(self, matcher: llguidance.LLMatcher, digits: DigitRun | None = None):
        self.matcher = matcher
        self.digits = digits

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (always one the mask allowed)."""
        self.matcher.consume_token(token_id)
        if self.digits is not None:
            self.digits.advance(token_id)

    @property
    def is_error(self) -> bool:
        return self.matcher.is_error()
