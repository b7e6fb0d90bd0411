"""Constrained decoding on the default model: grammars compile (or fail with a
reason), masks admit exactly the grammar's continuations, and every answer a
grammar ends parses and validates, whatever the seed and batch."""

import json
import re

import jsonschema
import numpy as np
import pytest

from pyllama_paged.constrain.digits import schema_digit_bound
from pyllama_paged.constrain.grammar import ConstraintError, closed_objects, compile_constraint
from pyllama_paged.constrain.masks import MaskBuffer
from pyllama_paged.errors import PagedError
from pyllama_paged.api.llama import Llama

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}},
          "required": ["name", "age", "pet"]}


@pytest.fixture(scope="module")
def llm():
    with Llama(n_ctx=512, n_threads=2) as model:
        yield model


@pytest.mark.parametrize("kind,spec,needle", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", [1, 2], "must be an object"),
    ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "invalid"),
    ("regex", "a(b", "invalid"),
    ("gbnf", "root ::= missing_rule", "missing_rule"),
    ("lark", "", "non-empty"),
    ("xml", "<a/>", "unknown constraint kind"),
])
def test_bad_grammars_are_refused_with_a_reason(llm, kind, spec, needle):
    with pytest.raises(ConstraintError, match=needle):
        compile_constraint(llm._tokenizer, kind, spec)


def test_schemas_are_closed_unless_they_say_otherwise():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "properties": {"type": "object", "additionalProperties": True,
                                                              "properties": {}}},
              "$defs": {"x": {"properties": {"y": {}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is True   # said so
    assert closed["$defs"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in schema   # the caller's schema is not modified


def test_mask_admits_a_valid_answer_token_by_token_then_only_the_end(llm):
    tok = llm._tokenizer
    state = compile_constraint(tok, "json_schema", PERSON).start()
    answer = json.dumps({"name": "Ada", "age": 36, "pet": "cat"}, separators=(",", ":"))
    buffer = MaskBuffer(tok.n_vocab)
    for token in tok.encode(answer, add_special=False):
        allowed = buffer.fill([state])[0]
        assert allowed[token] == 1, tok.tokens[token]
        assert 0 < allowed.sum() < tok.n_vocab
        state.accept(token)
    allowed = buffer.fill([state])[0]
    assert set(np.flatnonzero(allowed)) == set(tok.eot_ids)   # complete: only an end of turn
    wrong = compile_constraint(tok, "regex", r"[0-9]+").start()
    mask = buffer.fill([wrong])[0]
    assert mask[tok.encode("7", add_special=False)[0]] and not mask[tok.encode("x", add_special=False)[0]]
    assert not any(mask[t] for t in tok.eot_ids)   # empty is not a match: no end yet


def test_python_api_response_format_and_grammar(llm):
    out = llm.create_chat_completion([{"role": "user", "content": "Describe a person as JSON."}], seed=3,
                                     max_tokens=80, response_format={"type": "json_object", "schema": PERSON})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    out = llm.create_completion("My phone number is ", grammar='root ::= [0-9]{3} "-" [0-9]{4}',
                                max_tokens=20, seed=1)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out["choices"][0]["text"])
    with pytest.raises(ConstraintError):
        llm.create_completion("x", grammar="root ::= (", max_tokens=2)
    with pytest.raises(PagedError, match="beam_width"):
        llm.generate_batch(["x"], beam_width=2, response_format={"type": "json_object"})


def _valid_answers(llm, seeds, n):
    """Constrained answers batched with each other and with free ones: all parse."""
    prompts = ["A person, as JSON:", "Write JSON about someone.", "Free text:"]
    for seed in seeds:
        outs = llm.generate_batch(prompts[:2], max_tokens=80, seed=seed, n=n, temperature=1.0,
                                  response_format={"type": "json_schema", "json_schema": {"schema": PERSON}})
        for texts in outs:
            for text in texts:
                jsonschema.validate(json.loads(text), PERSON)


def test_every_constrained_answer_validates(llm):
    _valid_answers(llm, seeds=[7], n=2)


@pytest.mark.slow
def test_every_constrained_answer_validates_over_many_seeds(llm):
    _valid_answers(llm, seeds=range(100, 116), n=4)


# ---- a JSON number's digits are bounded (issue 54, item 1) --------------------------------
NUMBERS = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0},
                                            "height": {"type": "number"},
                                            "note": {"type": "string", "maxLength": 24}},
           "required": ["age", "height", "note"]}


def _advance(state, tok, text):
    for token in tok.encode(text, add_special=False):
        state.accept(token)


def _digits_admitted(state, tok, buffer, most=40):
    """How many '9's in a row the mask lets through (the most a model that prefers digits writes)."""
    nine = tok.encode("9", add_special=False)[0]
    for k in range(most):
        if not buffer.fill([state])[0][nine]:
            return k
        state.accept(nine)
    return most


@pytest.mark.parametrize("kind,spec,prefix", [
    ("json_schema", NUMBERS, '{"age":'),                              # an integer's digits
    ("json_schema", NUMBERS, '{"age":1,"height":-'),                  # a number's integral part
    ("json_schema", NUMBERS, '{"age":1,"height":0.'),                 # its fraction
    ("json_schema", NUMBERS, '{"age":1,"height":5e+'),                # its exponent
    ("json", None, '{"a":[1,{"b":'),                                  # any value of a free object
])
def test_a_json_number_takes_at_most_16_digits_in_a_run(llm, kind, spec, prefix):
    tok = llm._tokenizer
    buffer = MaskBuffer(tok.n_vocab)
    state = compile_constraint(tok, kind, spec).start()
    _advance(state, tok, prefix)
    assert _digits_admitted(state, tok, buffer) == 16   # the 17th digit is refused
    comma = tok.encode(",", add_special=False)[0]
    assert buffer.fill([state])[0][comma]                # and the answer goes on


def test_digits_in_strings_and_the_schemas_own_numbers_are_not_bounded(llm):
    tok = llm._tokenizer
    buffer = MaskBuffer(tok.n_vocab)
    state = compile_constraint(tok, "json_schema", NUMBERS).start()
    _advance(state, tok, '{"age":1,"height":2,"note":"')
    assert _digits_admitted(state, tok, buffer) == 24   # text, not a number: as many as maxLength
    # a schema that names a longer number keeps it reachable
    big = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 10 ** 17}}, "required": ["id"]}
    state = compile_constraint(tok, "json_schema", big).start()
    answer = '{"id":123456789012345678}'
    for token in tok.encode(answer, add_special=False):
        assert buffer.fill([state])[0][token]
        state.accept(token)
    assert set(np.flatnonzero(buffer.fill([state])[0])) == set(tok.eot_ids)
    assert schema_digit_bound({"minimum": 1e17}) == 18 and schema_digit_bound({"enum": [1.5, "x" * 40]}) == 16


def _digit_bias(tok) -> dict[int, float]:
    """A logit_bias that makes the model write a digit wherever one may stand."""
    return {tok.encode(str(d), add_special=False)[0]: 100.0 for d in range(10)}


def _outside_strings(text: str) -> str:
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def test_a_model_that_prefers_digits_still_ends_its_json(llm):
    tok = llm._tokenizer
    out = llm.create_chat_completion([{"role": "user", "content": "A person as JSON."}], seed=1, max_tokens=200,
                                     response_format={"type": "json_object", "schema": NUMBERS},
                                     logit_bias=_digit_bias(tok))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    answer = json.loads(choice["message"]["content"])
    jsonschema.validate(answer, NUMBERS)
    runs = re.findall(r"[0-9]+", _outside_strings(choice["message"]["content"]))
    assert runs and max(map(len, runs)) == 16   # the model took every digit it was let
