"""Each API's way of asking for structured output, turned into a Constraint:
OpenAI's response_format, Ollama's format, and llama-cpp-python's
response_format and grammar."""

from __future__ import annotations

from typing import Any

from ..tokenizer.tokenizer import Tokenizer
from .grammar import Constraint, ConstraintError, compile_constraint


def from_openai(tokenizer: Tokenizer, response_format: Any) -> Constraint | None:
    """OpenAI response_format: text, json_object, or json_schema ({"json_schema": {"schema": ...}})."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise ConstraintError("response_format must be an object with a 'type'")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")   # llama-cpp-python's extension
        return compile_constraint(tokenizer, "json_schema", schema) if schema else \
            compile_constraint(tokenizer, "json")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConstraintError("response_format.json_schema must be an object with a 'schema'")
        # strict or not, the answer is held to the schema: a loose schema is the user's choice
        return compile_constraint(tokenizer, "json_schema", spec["schema"])
    raise ConstraintError(f"response_format.type '{kind}' is not one of text, json_object, json_schema")


def from_ollama(tokenizer: Tokenizer, fmt: Any) -> Constraint | None:
    """Ollama format: "json", a JSON schema object, or empty."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return compile_constraint(tokenizer, "json")
    if isinstance(fmt, dict):
        return compile_constraint(tokenizer, "json_schema", fmt)
    raise ConstraintError("format must be \"json\" or a JSON schema object")


def from_python(tokenizer: Tokenizer, response_format: Any = None, grammar: Any = None) -> Constraint | None:
    """The Python API: response_format as OpenAI's, grammar as GBNF text (or an object with
    a `grammar`/`_grammar` string, as llama-cpp-python's LlamaGrammar holds it)."""
    if grammar is not None and response_format is not None:
        raise ConstraintError("give either grammar or response_format, not both")
    if grammar is not None:
        spec = getattr(grammar, "constraint_spec", None)   # our LlamaGrammar: GBNF or a JSON schema
        if callable(spec):
            return compile_constraint(tokenizer, *spec())
        text = grammar if isinstance(grammar, str) else getattr(grammar, "grammar", getattr(grammar, "_grammar", None))
        if not isinstance(text, str):
            raise ConstraintError("grammar must be GBNF text")
        return compile_constraint(tokenizer, "gbnf", text)
    return from_openai(tokenizer, response_format)
