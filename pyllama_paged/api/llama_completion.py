"""Text completions in llama-cpp-python's shapes: the stream of chunks (the
last carries finish_reason and usage) and the collected answer."""

from __future__ import annotations

import time
import uuid
from typing import Iterator


def completion_chunks(llama, prompt, prompt_ids: list[int], params, echo: bool, model: str,
                      criteria=None) -> Iterator[dict]:
    """The completion stream: text (and logprobs) as it comes, then a final chunk."""
    cid = f"cmpl-{uuid.uuid4()}"
    created = int(time.time())
    completion_tokens = 0

    def chunk(text, finish_reason=None, lp=None):
        return {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish_reason}]}

    def piece(token_id):
        return llama._tokenizer.token_to_piece(token_id).decode("utf-8", "replace")

    if echo:
        yield chunk(prompt if isinstance(prompt, str) else llama.detokenize(prompt_ids).decode("utf-8", "replace"))
    finish = "length"
    for _, _, text, finish_reason, event in llama.stream_texts([prompt_ids], params, criteria):
        lp = None
        if event is not None:
            completion_tokens += 1
            if event.logprob is not None:
                lp = {"tokens": [piece(event.token_id)], "text_offset": [0], "token_logprobs": [event.logprob],
                      "top_logprobs": [{piece(t): v for t, v in event.top_logprobs.items()}]}
        if text or lp:
            yield chunk(text, lp=lp)
        finish = finish_reason or finish
    final = chunk("", finish)
    final["usage"] = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens}
    yield final


def collect_completion(chunks) -> dict:
    """The non-streamed completion built from the chunks (text offsets into the whole text)."""
    text, lps, last = [], None, None
    for c in chunks:
        choice = c["choices"][0]
        text.append(choice["text"])
        if choice["logprobs"]:
            if lps is None:
                lps = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
            offset = sum(len(t) for t in text[:-1])
            for k in ("tokens", "token_logprobs", "top_logprobs"):
                lps[k].extend(choice["logprobs"][k])
            lps["text_offset"].append(offset)
        last = c
    result = {k: last[k] for k in ("id", "object", "created", "model")}
    result["choices"] = [{"text": "".join(text), "index": 0, "logprobs": lps,
                          "finish_reason": last["choices"][0]["finish_reason"]}]
    result["usage"] = last["usage"]
    return result
