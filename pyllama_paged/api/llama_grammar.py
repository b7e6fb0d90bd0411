"""LlamaGrammar: llama-cpp-python's grammar object, backed by constrain/ (llguidance).

It holds the grammar's source only; Llama compiles it against its own
vocabulary when a generation asks for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llguidance

from ..constrain.grammar import ConstraintError, json_schema_object

LLAMA_GRAMMAR_DEFAULT_ROOT = "root"


class LlamaGrammar:
    """A GBNF grammar (llama.cpp's format) or a JSON schema that constrains generation."""

    def __init__(self, *args, _grammar: str | None = None, _json_schema: Any = None, **kwargs):
        if (_grammar is None) == (_json_schema is None):
            raise ConstraintError("a LlamaGrammar holds either a GBNF grammar or a JSON schema")
        self._grammar = _grammar
        self._json_schema = _json_schema
        self._root = LLAMA_GRAMMAR_DEFAULT_ROOT

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> "LlamaGrammar":
        """A GBNF grammar; ValueError (ConstraintError) naming the fault if it does not parse."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise ConstraintError("the GBNF grammar must be a non-empty string")
        try:
            llguidance.grammar_from("gbnf", grammar)   # parsed now: a bad grammar fails here, not mid-run
        except ValueError as e:
            raise ConstraintError(f"the GBNF grammar does not parse: {e}") from None
        return cls(_grammar=grammar)

    @classmethod
    def from_file(cls, file: str | Path, verbose: bool = True) -> "LlamaGrammar":
        """A GBNF grammar read from a file."""
        try:
            text = Path(file).read_text(encoding="utf-8")
        except OSError as e:
            raise ConstraintError(f"cannot read grammar file {file}: {e.strerror}") from None
        if not text.strip():
            raise ConstraintError(f"grammar file {file} is empty")
        return cls.from_string(text, verbose=verbose)

    @classmethod
    def from_json_schema(cls, json_schema: str, verbose: bool = True) -> "LlamaGrammar":
        """A JSON schema (as JSON text, or a dict) the output must validate against."""
        return cls(_json_schema=json_schema_object(json_schema))

    def constraint_spec(self) -> tuple[str, Any]:
        """(kind, source) as constrain.grammar.compile_constraint takes them."""
        return ("gbnf", self._grammar) if self._grammar is not None else ("json_schema", self._json_schema)

    @property
    def grammar(self) -> str | None:
        return self._grammar

    def __repr__(self) -> str:
        kind, _ = self.constraint_spec()
        return f"LlamaGrammar({kind})"
