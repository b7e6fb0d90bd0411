"""Anthropic's conversation in the chat shape the templates and tool machinery read
(system, text, tool_use and tool_result blocks -> OpenAI-style messages, tools and
tool_choice), and an answer back as Anthropic content blocks and a stop reason."""

from __future__ import annotations

from typing import Any

from ...calls.chat_call import ChatCall
from ...calls.sampling_options import OPENAI
from ...tools.calls import ToolCall
from ...tools.reasoning import template_thinks
from ...tools.messages import MessageError
from .schemas import Block, MessagesRequest

# thinking blocks a client replays from an earlier turn: Anthropic drops them from the
# context too, as the templates of models that think drop old thinking
_DROPPED = ("thinking", "redacted_thinking")
_UNSUPPORTED = ("document", "search_result", "container_upload")


def _text(block: Block, where: str) -> str:
    if not isinstance(block.text, str):
        raise MessageError(f"{where}: a text block needs \"text\"")
    return block.text


def _refuse(kind: str, where: str, allowed: str) -> None:
    if kind in _UNSUPPORTED:
        raise MessageError(f"{where}: {kind} blocks are not supported by this model")
    raise MessageError(f"{where}.type '{kind}' is not one of {allowed}")


def system_text(system: str | list[Block] | None) -> str:
    """The system prompt as one string (Anthropic allows a list of text blocks)."""
    if system is None or isinstance(system, str):
        return system or ""
    parts = []
    for j, block in enumerate(system):
        if block.type != "text":
            _refuse(block.type, f"system[{j}]", "text")
        parts.append(_text(block, f"system[{j}]"))
    return "\n\n".join(parts)


def _result_text(block: Block, where: str) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str):
                _refuse(kind, f"{where}.content[{k}]", "text")
            parts.append(part["text"])
        text = "\n".join(parts)
    # the model reads the result as text: say that the tool failed, as the flag does
    return f"Error: {text}" if block.is_error else text


def _tool_call(block: Block, where: str) -> dict:
    if not isinstance(block.id, str) or not isinstance(block.name, str):
        raise MessageError(f"{where}: a tool_use block needs \"id\" and \"name\"")
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input or {}}}


def _tool_message(block: Block, where: str) -> dict:
    if not isinstance(block.tool_use_id, str):
        raise MessageError(f"{where}: a tool_result block needs \"tool_use_id\"")
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, where)}


def _image(block: Block, where: str) -> dict:
    """An image block as the chat shape's image_url part (the chat path reads or refuses it)."""
    source = getattr(block, "source", None)
    if not isinstance(source, dict) or source.get("type") not in ("base64", "url"):
        raise MessageError(f"{where}: an image block needs a source of type base64 or url")
    if source["type"] == "url":
        return {"type": "image_url", "image_url": {"url": str(source.get("url", ""))}}
    return {"type": "image_url", "image_url": {
        "url": f"data:{source.get('media_type', 'image')};base64,{source.get('data', '')}"}}


def _content(parts: list[dict]) -> str | list[dict]:
    """A turn's text and image parts: one string when all are text (the shape templates read)."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _turn(role: str, blocks: list[Block], where: str) -> list[dict]:
    """One turn's blocks as chat messages, in the order given: a user's tool_result blocks
    become tool messages between its text; an assistant's tool_use blocks its tool calls."""
    own = "tool_result" if role == "user" else "tool_use"
    out, text, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            text.append({"type": "text", "text": _text(block, at)})
        elif block.type == "image" and role == "user":
            text.append(_image(block, at))
        elif block.type == own == "tool_use":
            calls.append(_tool_call(block, at))
        elif block.type == own:
            if text:
                out.append({"role": role, "content": _content(text)})
                text = []
            out.append(_tool_message(block, at))
        elif not (role == "assistant" and block.type in _DROPPED):
            _refuse(block.type, at, f"text or {own}")
    if text or calls or not out:
        message: dict[str, Any] = {"role": role, "content": _content(text)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def chat_messages(body: MessagesRequest) -> list[dict]:
    """The request's system prompt and turns as OpenAI-shaped chat messages (which
    tools.messages.normalize_messages reads); MessageError names the bad block."""
    out = []
    system = system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        else:
            out += _turn(m.role, m.content, where)
    return out


def chat_tools(body: MessagesRequest) -> tuple[list[dict] | None, Any]:
    """(tools, tool_choice) in the OpenAI shape tools.prompt.prepare_chat reads."""
    tools = None
    if body.tools:
        tools = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}} for t in body.tools]
    choice = body.tool_choice
    if choice is None:
        return tools, None
    if choice.type == "tool":
        if not choice.name:
            raise MessageError("tool_choice of type 'tool' needs the tool's \"name\"")
        return tools, {"type": "function", "function": {"name": choice.name}}
    return tools, {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_call(body: MessagesRequest) -> ChatCall:
    """The request as the server's chat path takes it; MessageError names a bad block."""
    tools, tool_choice = chat_tools(body)
    # Anthropic's sampling defaults (temperature 1, no top_p/top_k cut) are the OpenAI surface's
    return ChatCall(messages=chat_messages(body), tools=tools, tool_choice=tool_choice, structured=body.constraint,
                    surface=OPENAI, sampling=body.sampling(), model=body.model, thinking=body.thinking_switch(),
                    thinking_budget=body.thinking_budget(),
                    limit_fields={"stop": body.stop_sequences, "messages": body.messages, "tools": body.tools,
                                  "grammars": {"output_config": body.schema()}},
                    refuse_unsupported=lambda served: body.refuse_unsupported(template_thinks(served.template.source)),
                    messages_param=None)


def tool_use_block(call: ToolCall) -> dict:
    """A parsed tool call as Anthropic's tool_use block (ids in Anthropic's toolu_ style)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments}


def thinking_block(thinking: str) -> dict:
    """A thinking block (its signature empty: nothing here signs a model's thinking)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def content_blocks(text: str, calls: list[ToolCall], thinking: str | None = None) -> list[dict]:
    """The answer's content: its thinking block (thinking None: none), then its text (always a
    block when there is no tool call, as a client reads content[0].text), then a tool_use
    block per call."""
    blocks = [thinking_block(thinking)] if thinking is not None else []
    blocks += [{"type": "text", "text": text}] if text or not calls else []
    return blocks + [tool_use_block(c) for c in calls]


def stop_reason(finish: str | None, stop: str | None, calls: list[ToolCall]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for how the generation ended."""
    if calls:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if stop is not None:
        return "stop_sequence", stop
    return "end_turn", None

