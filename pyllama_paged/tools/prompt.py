"""Tools into the prompt and forced calls into a grammar, per template family.

A template that knows tools (its Jinja source reads `tools`) gets them as
transformers passes them: a list of {"type": "function", "function": {...}},
with assistant messages' `tool_calls` arguments as objects. A template that
does not (our built-in ones, Gemma 3's) gets the tools described in a system
message and the tool history written out as text, so any model can be asked."""

from __future__ import annotations

import json
from typing import Any

from ..constrain.digits import schema_digit_bound
from ..constrain.grammar import Constraint, ConstraintError, closed_objects, compile_constraint
from ..tokenizer.chat_template import ChatPrompt, ChatTemplate, Escape, no_escape
from ..tokenizer.tokenizer import Tokenizer
from .gemma4 import CALL_OPEN
from .reasoning import speaks_harmony

FAMILIES = ("qwen_xml", "hermes", "llama3", "mistral", "json", "gemma4")
# Qwen3.5/3.6's (and Qwen3-Coder's) templates ask for calls as XML inside <tool_call>
QWEN_XML_MARK = "<function="


def tool_family(template: ChatTemplate, tokenizer: Tokenizer) -> str:
    """Which way this model writes tool calls."""
    def has(token: str) -> bool:
        return tokenizer.token_to_id(token) is not None

    source = template.source
    if CALL_OPEN in source or has(CALL_OPEN):
        return "gemma4"
    if QWEN_XML_MARK in source:
        return "qwen_xml"
    if "<tool_call>" in source or has("<tool_call>"):
        return "hermes"
    if "[TOOL_CALLS]" in source or has("[TOOL_CALLS]"):
        return "mistral"
    if has("<|python_tag|>") or has("<|start_header_id|>"):
        return "llama3"
    return "json"


def _args_key(family: str) -> str:
    return "parameters" if family == "llama3" else "arguments"


def _xml_value_rule(schema: dict) -> str:
    """A lark rule body for one XML parameter's value: a line of text for a string, one of
    the literals of a string enum, else the JSON of its schema."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return " | ".join(json.dumps(v) for v in enum)
    if schema.get("type") == "string" and "const" not in schema:
        return "/[^<\\n]+/"
    return "%json " + json.dumps(closed_objects(schema))


def _xml_call_lark(tools: list[dict]) -> tuple[str, list[dict]]:
    """(lark grammar, the parameters' schemas) admitting one Qwen3.5-style XML call to one
    of tools: its required parameters in the schema's order, each optional one or not."""
    def literal(text: str) -> str:
        return json.dumps(text)

    nl = "\n"
    rules, calls, schemas = [], [], []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        params = fn.get("parameters") or {}
        required = set(params.get("required") or ())
        items = []
        for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
            schema = schema if isinstance(schema, dict) else {}
            schemas.append(schema)
            rules.append(f"v{i}_{j}: {_xml_value_rule(schema)}")
            opening, closing = literal(f"<parameter={key}>{nl}"), literal(f"{nl}</parameter>{nl}")
            rules.append(f"p{i}_{j}: {opening} v{i}_{j} {closing}")
            items.append(f"p{i}_{j}" + ("" if key in required else "?"))
        name = fn["name"]
        rules.append(f"call{i}: {literal(f'<function={name}>{nl}')} {' '.join(items)} {literal(f'</function>{nl}')}")
        calls.append(f"call{i}")
    start = f"start: {literal(f'<tool_call>{nl}')} ({' | '.join(calls)}) {literal('</tool_call>')}"
    return nl.join([start, *rules]), schemas


def _describe(tools: list[dict], family: str, escape: Escape = no_escape) -> str:
    key = _args_key(family)
    example = {"name": "function_name", key: {"argument": "value"}}
    if family == "hermes":
        how = f"<tool_call>\n{json.dumps(example)}\n</tool_call>"
    elif family == "mistral":
        how = json.dumps([example])
    else:
        how = json.dumps(example)
    # escaped as serialized: the JSON text is what the prompt holds, so its strings come back as written
    listing = "\n".join(escape(json.dumps(t)) for t in tools)
    return ("You can call these functions:\n" + listing + "\n\nTo call one, answer with only\n" + how +
            "\nand nothing else. Otherwise answer normally.")


def _tool_history_as_text(messages: list[dict], family: str, escape: Escape = no_escape) -> list[dict]:
    """The messages with tool calls and results written out as text; what the request sent
    goes through escape, our own markup around it does not."""
    key = _args_key(family)
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], key: c["function"]["arguments"]} for c in m["tool_calls"]]
            text = escape(json.dumps(calls if len(calls) > 1 or family == "mistral" else calls[0]))
            if family == "hermes":
                text = "\n".join(f"<tool_call>\n{escape(json.dumps(c))}\n</tool_call>" for c in calls)
            out.append({"role": "assistant", "content": (escape(m.get("content") or "") + "\n" + text).strip()})
        elif m["role"] == "tool":
            name = escape(m.get("name") or m.get("tool_name") or "the function")
            out.append({"role": "user", "content": f"Result of {name}: {escape(m.get('content') or '')}"})
        else:
            out.append({"role": m["role"], "content": escape(m.get("content") or "")})
    return out


def knows_tools(template: ChatTemplate) -> bool:
    """Whether the template renders `tools` and tool history itself."""
    return "tools" in template.source and "tool_calls" in template.source


def render_chat(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict],
                tools: list[dict] | None = None, variables: dict | None = None) -> ChatPrompt:
    """Prompt text for messages (with tool history) and the tools offered, if any: a
    ``ChatPrompt``, whose tokens (``tokenizer.encode(text, parse_special=True)``) hold control
    tokens only where the template or our tool markup put them."""
    if knows_tools(template):
        return template.render(messages, tools=tools or None, variables=variables)
    family = tool_family(template, tokenizer)

    def inputs(escape: Escape):
        plain = _tool_history_as_text(messages, family, escape)
        if tools:
            system = _describe(tools, family, escape)
            if plain and plain[0]["role"] == "system":
                plain[0] = {"role": "system", "content": plain[0]["content"] + "\n\n" + system}
            else:
                plain.insert(0, {"role": "system", "content": system})
        return plain, None

    return template.render_with(inputs, variables=variables)


def _call_schema(tool: dict, family: str) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, _args_key(family): params},
            "required": ["name", _args_key(family)], "additionalProperties": False}


def forced_call_constraint(tokenizer: Tokenizer, family: str, tools: list[dict],
                           only: str | None = None) -> Constraint:
    """A grammar that admits only a call to one of the tools (or the one named)."""
    chosen = [t for t in tools if only is None or t["function"]["name"] == only]
    if not chosen:
        raise ConstraintError(f"tool_choice names '{only}', which is not among the tools")
    if family == "qwen_xml":
        lark, params = _xml_call_lark(chosen)
        return compile_constraint(tokenizer, "lark", lark, digit_bound=schema_digit_bound(params))
    schemas = [closed_objects(_call_schema(t, family)) for t in chosen]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if family == "mistral":
        return compile_constraint(tokenizer, "json_schema", {"type": "array", "items": one, "minItems": 1})
    if family == "hermes":
        lark = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(one)
        return compile_constraint(tokenizer, "lark", lark, digit_bound=schema_digit_bound(one))
    return compile_constraint(tokenizer, "json_schema", one)


def check_tools(tools: Any) -> list[dict]:
    """The tools list in transformers' shape; ConstraintError for a malformed one."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ConstraintError("tools must be a list")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ConstraintError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ConstraintError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"type": "function", "function": fn})
    return out


def plan_tools(template: ChatTemplate, tokenizer: Tokenizer, tools: Any = None, tool_choice: Any = None,
               constraint: Constraint | None = None) -> tuple[list[dict], Constraint | None, set[str]]:
    """(the tools to offer in the prompt, the constraint to decode with, names of the tools
    whose calls to parse) for OpenAI-shaped tools and tool_choice: None (auto when tools are
    given), "none", "auto", "required", or {"type": "function", "function": {"name": ...}}.
    ConstraintError for a tool_choice that cannot be met."""
    tools = check_tools(tools)
    mode = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if mode not in ("none", "auto", "required") and not isinstance(mode, dict):
        raise ConstraintError(f"tool_choice {mode!r} is not none, auto, required or a named function")
    offered = tools if mode != "none" else []
    if mode == "required" or isinstance(mode, dict):
        if not tools:
            raise ConstraintError("tool_choice asks for a tool call but no tools are given")
        if constraint is not None:
            raise ConstraintError("response_format cannot be combined with a forced tool_choice")
        if speaks_harmony(template.source):
            # its call is a commentary message after the analysis, which a bare JSON grammar forbids
            raise ConstraintError("a forced tool_choice ('required' or a named function) is not supported yet for "
                                  "a harmony model (gpt-oss): use tool_choice 'auto'")
        if tool_family(template, tokenizer) == "gemma4":
            # its calls are in Gemma 4's own notation, not JSON, which no grammar here writes yet
            raise ConstraintError("a forced tool_choice ('required' or a named function) is not supported yet for "
                                  "Gemma 4: use tool_choice 'auto'")
        only = None
        if isinstance(mode, dict):
            only = (mode.get("function") or {}).get("name")
            if not isinstance(only, str):
                raise ConstraintError("tool_choice must name a function: "
                                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        constraint = forced_call_constraint(tokenizer, tool_family(template, tokenizer), tools, only)
    return offered, constraint, {t["function"]["name"] for t in offered}


def prepare_chat(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict], tools: Any = None,
                 tool_choice: Any = None, constraint: Constraint | None = None
                 ) -> tuple[ChatPrompt, Constraint | None, set[str]]:
    """(prompt text, the constraint to decode with, names of the tools whose calls to parse)
    for OpenAI-shaped chat fields (see plan_tools). The text is a ``ChatPrompt``:
    ``tokenizer.encode(text, parse_special=True)`` (or ``text.token_ids(tokenizer)``) keeps
    request text out of control tokens."""
    offered, constraint, names = plan_tools(template, tokenizer, tools, tool_choice, constraint)
    return render_chat(template, tokenizer, messages, offered), constraint, names
