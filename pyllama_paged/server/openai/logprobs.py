"""Token log-probabilities in OpenAI's two shapes: completions' parallel lists
(prompt tokens first when echoed) and chat's list of token objects."""

from __future__ import annotations

from ...tokenizer.tokenizer import Tokenizer


def _piece(tok: Tokenizer, token_id: int) -> bytes:
    return tok.token_to_piece(token_id, special=False)


def _text(tok: Tokenizer, token_id: int) -> str:
    return _piece(tok, token_id).decode("utf-8", "replace")


def completion_logprobs(tok: Tokenizer, prompt_ids: list[int], prompt_lps, events) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} over the echoed prompt
    (prompt_lps from engine.prompt_logprobs) then the generated tokens."""
    tokens, lps, tops, offsets = [], [], [], []
    offset = 0

    def add(token_id, lp, top):
        nonlocal offset
        text = _text(tok, token_id)
        tokens.append(text)
        lps.append(lp)
        tops.append({_text(tok, t): v for t, v in top.items()} if top is not None else None)
        offsets.append(offset)
        offset += len(text)

    for token_id, (lp, top) in zip(prompt_ids, prompt_lps or [(None, None)] * len(prompt_ids)):
        add(token_id, lp, top if lp is not None else None)
    for ev in events:
        if ev.token_id in tok.eot_ids:
            continue
        add(ev.token_id, ev.logprob, ev.top_logprobs or {})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok: Tokenizer, events) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}"""
    content = []
    for ev in events:
        if ev.token_id in tok.eot_ids:
            continue
        piece = _piece(tok, ev.token_id)
        top = [{"token": _text(tok, t), "logprob": v, "bytes": list(_piece(tok, t))}
               for t, v in (ev.top_logprobs or {}).items()]
        content.append({"token": piece.decode("utf-8", "replace"), "logprob": ev.logprob,
                        "bytes": list(piece), "top_logprobs": top})
    return {"content": content, "refusal": None}
