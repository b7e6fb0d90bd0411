"""What the unmodified clients get back from the server's chat routes: a reply's thinking, answer
and tool calls, whole or put together from its stream, read the same way for every chat format
the tests script (tests/server/test_gemma4_chat.py)."""

from __future__ import annotations

import json


def chat_prompt_ids(template_source: str, tokenizer, messages: list, **call_fields) -> list[int]:
    """The prompt the server's one chat path makes of messages (call_fields: the ChatCall's others,
    e.g. tools, thinking) under a template: what a model scripted for it is given."""
    from ..calls.chat_call import ChatCall, prepare_call
    from ..tokenizer.chat_template import ChatTemplate

    return prepare_call(ChatCall(messages=messages, **call_fields), ChatTemplate(template_source), tokenizer).prompt_ids


def openai_reply(client, model: str, messages: list, stream: bool = False, **fields) -> tuple[str, str, list]:
    """(reasoning_content, content, [(name, arguments)]) of an openai-client chat completion."""
    if not stream:
        message = client.chat.completions.create(model=model, messages=messages, **fields).choices[0].message
        return ((message.model_extra or {}).get("reasoning_content") or "", message.content or "",
                [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []])
    thinking, content, calls = [], [], []
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **fields):
        if chunk.choices:
            delta = chunk.choices[0].delta
            thinking.append((delta.model_extra or {}).get("reasoning_content") or "")
            content.append(delta.content or "")
            calls += [(t.function.name, json.loads(t.function.arguments)) for t in delta.tool_calls or []]
    return "".join(thinking), "".join(content), calls


def ollama_reply(client, model: str, messages: list, stream: bool = False, **fields) -> tuple[str, str, list]:
    """(thinking, content, [(name, arguments)]) of an ollama-client chat."""
    chunks = client.chat(model=model, messages=messages, stream=stream, **fields)
    chunks = list(chunks) if stream else [chunks]
    return ("".join(c.message.thinking or "" for c in chunks), "".join(c.message.content or "" for c in chunks),
            [(t.function.name, dict(t.function.arguments)) for c in chunks for t in c.message.tool_calls or []])


def llama_reply(llm, messages: list, stream: bool = False, **fields) -> tuple[str, str]:
    """(reasoning_content, content) of Llama.create_chat_completion, whole or summed over its chunks."""
    if not stream:
        message = llm.create_chat_completion(messages, **fields)["choices"][0]["message"]
        return message.get("reasoning_content") or "", message["content"] or ""
    deltas = [c["choices"][0]["delta"] for c in llm.create_chat_completion(messages, stream=True, **fields)]
    return "".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content") or "" for d in deltas)
