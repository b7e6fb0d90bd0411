"""Chat completions in llama-cpp-python's shapes: the stream of chunks (first
the role, then content, tool calls and logprobs, each sample ending with a
chunk whose choices[0] carries its finish_reason) and the collected answer."""

from __future__ import annotations

import time
import uuid
from contextlib import closing
from typing import Iterator

from ..calls.chat_call import AnswerSplitter
from ..calls.text_stream import TextDelta
from ..tools.harmony import HarmonyTokens


def token_logprob(tokenizer, event) -> dict:
    """One token's entry of OpenAI's chat logprobs content."""
    def piece(token_id):
        return tokenizer.token_to_piece(token_id).decode("utf-8", "replace")

    return {"token": piece(event.token_id), "logprob": event.logprob, "bytes": None,
            "top_logprobs": [{"token": piece(t), "logprob": v, "bytes": None}
                             for t, v in (event.top_logprobs or {}).items()]}


def legacy_functions(functions, function_call, tools, tool_choice):
    """OpenAI's deprecated functions/function_call as tools/tool_choice."""
    if functions is not None and tools is None:
        tools = [{"type": "function", "function": f} for f in functions]
    if function_call is not None and tool_choice is None:
        tool_choice = ({"type": "function", "function": {"name": function_call["name"]}}
                       if isinstance(function_call, dict) else function_call)
    return tools, tool_choice


def chat_chunks(llama, prompt_ids: list[int], params, names: set[str], model: str,
                stopping_criteria=None, thinks: bool = False, opens_thinking: bool = False,
                harmony: HarmonyTokens | None = None, images=()) -> Iterator[dict]:
    """The chat stream: every chunk has choices[0]; the last one also carries usage. A model
    that thinks (thinks; opens_thinking: its prompt opened the block) sends its thinking as
    reasoning_content deltas, as OpenAI-compatible servers do; a harmony reply (harmony) is read
    by its channels. images: the prompt's, placed by prepare_call."""
    cid, created = f"chatcmpl-{uuid.uuid4()}", int(time.time())
    started: set = set()
    counts: dict = {}
    splitter = AnswerSplitter(names, thinks, opens_thinking, harmony)
    want_logprobs = params.logprobs is not None

    def chunk(j, delta, finish=None, logprobs=None):
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": j, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    width = params.beam_width if params.beam_width > 1 else params.n

    def chunks():
        with closing(llama.stream_texts([prompt_ids], params, stopping_criteria, [list(images)])) as texts:
            for _, j, text, finish, ev in texts:
                if splitter.cut(j) is None:
                    yield from sample_chunks(j, text, finish, ev)
                if splitter.all_ended(width):   # every sample ended, some by their calls: stop generating
                    return

    def sample_chunks(j, text, finish, ev):
        """The chunks one sample's text delta makes."""
        if j not in started:
            started.add(j)
            yield chunk(j, {"role": "assistant"})
        counts[j] = counts.get(j, 0) + (1 if ev is not None else 0)
        lp = None
        if want_logprobs and ev is not None and ev.logprob is not None:
            lp = {"content": [token_logprob(llama._tokenizer, ev)], "refusal": None}
        piece = splitter.feed(TextDelta(j, text, finish, ev))
        if piece.thinking:
            yield chunk(j, {"reasoning_content": piece.thinking})
        if piece.text or lp:
            yield chunk(j, {"content": piece.text}, logprobs=lp)
        if piece.calls:
            yield chunk(j, {"tool_calls": [c.openai(k) for k, c in enumerate(piece.calls)]})
        if piece.finish_reason:
            yield chunk(j, {}, "tool_calls" if piece.calls else piece.finish_reason)

    last = None
    for c in chunks():
        if last is not None:
            yield last
        last = c
    if last is not None:   # usage rides on the final chunk: no chunk has empty choices
        generated = sum(counts.values())
        last["usage"] = {"prompt_tokens": len(prompt_ids), "completion_tokens": generated,
                         "total_tokens": len(prompt_ids) + generated}
        yield last


def collect_chat(chunks, n: int) -> dict:
    """The non-streamed chat completion built from the chunks."""
    texts = [""] * n
    thinking = [""] * n
    finish = [None] * n
    logprobs: list = [None] * n
    tool_calls: list[list] = [[] for _ in range(n)]
    head = usage = None
    for c in chunks:
        head = head or c
        usage = c.get("usage", usage)
        for ch in c["choices"]:
            j = ch["index"]
            texts[j] += ch["delta"].get("content", "")
            thinking[j] += ch["delta"].get("reasoning_content", "")
            tool_calls[j] += [{k: v for k, v in call.items() if k != "index"}
                              for call in ch["delta"].get("tool_calls", [])]
            finish[j] = ch["finish_reason"] or finish[j]
            if ch["logprobs"]:
                logprobs[j] = logprobs[j] or {"content": [], "refusal": None}
                logprobs[j]["content"] += ch["logprobs"]["content"]

    def message(j):
        out = {"role": "assistant", "content": texts[j]}
        if tool_calls[j]:
            out = {"role": "assistant", "content": texts[j] or None, "tool_calls": tool_calls[j]}
        if thinking[j]:
            out["reasoning_content"] = thinking[j]
        return out

    return {"id": head["id"], "object": "chat.completion", "created": head["created"], "model": head["model"],
            "choices": [{"index": j, "message": message(j), "logprobs": logprobs[j], "finish_reason": finish[j]}
                        for j in range(n)],
            "usage": usage}
