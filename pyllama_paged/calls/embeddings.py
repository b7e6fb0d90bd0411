"""Embeddings as the APIs give them: inputs tokenized and fitted to the model's
context (truncated, or refused with the reason), vectors shortened to
`dimensions` and L2-normalized, and the llama-cpp-python / OpenAI response
shapes, and many inputs run through an engine's shared steps at once. The engine
does the pooling (engine/pooling/embedding.py)."""

from __future__ import annotations

import base64
from typing import Sequence

import numpy as np

from ..engine import POOLINGS, TOKEN_STATES, EmbedParams, default_pooling
from ..errors import PagedError


class InputTooLong(PagedError, ValueError):
    """An input has more tokens than the model takes and truncation is off."""


def run_embeddings(steps, inputs: list[list[int]], params: EmbedParams | list[EmbedParams]) -> list[np.ndarray]:
    """Embed many token lists through an engine's SharedSteps (LLMEngine or EncoderEngine),
    all queued at once so the scheduler batches them (with whatever else is running);
    returns the pooled vectors in order. params: one for all inputs, or one each.
    PagedError (every input aborted) if one fails."""
    requests = []
    try:
        for i, ids in enumerate(inputs):
            request = steps.add_request(list(ids), params[i] if isinstance(params, list) else params)
            if request.error:
                raise PagedError(f"input {i}: {request.error}")
            requests.append(request)
        index = {r.request_id: i for i, r in enumerate(requests)}
        vectors: list[np.ndarray | None] = [None] * len(inputs)
        while outputs := steps.next_outputs(index):
            for out in outputs:
                i = index[out.request_id]
                if out.error:
                    raise PagedError(f"input {i}: {out.error}")
                if out.embedding is not None:
                    vectors[i] = out.embedding
        missing = [i for i, v in enumerate(vectors) if v is None]
        if missing:
            raise PagedError(f"input {missing[0]}: finished without an embedding")
        return vectors
    finally:
        for r in requests:
            steps.abort(r.request_id)


def max_input_tokens(engine) -> int:
    """The most tokens one input may have on this engine (a decoder keeps one slot free)."""
    limit = engine.limit
    return limit if engine.is_encoder else limit - 1


def fit_input(ids: list[int], limit: int, truncate: bool, tail_id: int | None, index: int = 0) -> list[int]:
    """ids within limit tokens: cut at the end (keeping a closing token the tokenizer added, such
    as BERT's [SEP]) when truncate is set; InputTooLong otherwise."""
    if len(ids) <= limit:
        return ids
    if not truncate:
        raise InputTooLong(f"input {index} is {len(ids)} tokens; the model takes at most {limit} "
                           "(set truncate to cut it)")
    if tail_id is not None and ids and ids[-1] == tail_id:
        return ids[:limit - 1] + [tail_id]
    return ids[:limit]


def tokenize_inputs(tokenizer, texts: Sequence[str], limit: int, truncate: bool) -> list[list[int]]:
    """Each text's token ids (the model's special tokens added) fitted to limit."""
    tail = tokenizer.eos_id if tokenizer.add_eos else None
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text, add_special=True, parse_special=False)
        if not ids:
            raise PagedError(f"input {i} is empty")
        out.append(fit_input(ids, limit, truncate, tail, i))
    return out


def finish_vector(vector: np.ndarray, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
    """The first `dimensions` components (all when None), then scaled to unit length when
    normalize is set (a zero vector stays zero)."""
    if dimensions is not None:
        if not 1 <= dimensions <= len(vector):
            raise PagedError(f"dimensions {dimensions} must be between 1 and the model's {len(vector)}")
        vector = vector[:dimensions]
    vector = vector.astype(np.float32)
    if normalize:
        norm = float(np.linalg.norm(vector.astype(np.float64)))
        if norm > 0:
            vector = vector / norm
    return vector


def as_base64(vector: np.ndarray) -> str:
    """OpenAI's encoding_format "base64": the little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def openai_list(vectors: list, model: str, prompt_tokens: int) -> dict:
    """OpenAI's (and llama-cpp-python's create_embedding) response object."""
    return {"object": "list",
            "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)],
            "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def token_states_wanted(llm, pooling: str | None) -> bool:
    """Whether Llama.embed answers one vector per token, as llama-cpp-python does where no
    pooling applies: Llama(pooling_type=0), or a decoder whose GGUF names no pooling and
    no pooling asked for. A pooling given by the call, the constructor or the file pools."""
    from ..gguf.config import POOLING_TYPES

    if pooling is not None:
        return False
    asked = POOLING_TYPES.get(getattr(llm, "pooling_type_arg", -1))
    config = llm._model.config
    if asked == "none":
        if config.is_encoder:
            raise PagedError("pooling_type=0 (one vector per token) is for decoder models; this encoder "
                             f"pools ({config.pooling or 'mean'})")
        return True
    return asked is None and config.pooling in (None, "none") and not config.is_encoder


def embed_for_llama(llm, input, normalize: bool, truncate: bool, pooling: str | None,
                    dimensions: int | None, per_token: bool = False) -> tuple[list, int]:
    """Llama.embed's work: (a vector for a str or a list of them for a list, tokens used); with
    per_token, where no pooling applies (token_states_wanted) each input's vector is a list
    of its tokens' vectors, each finished (cut to dimensions, normalized) on its own."""
    from ..gguf.config import POOLING_TYPES

    steps = llm._shared_steps()
    single = isinstance(input, str)
    texts = [input] if single else list(input)
    if not texts:
        raise PagedError("no input to embed")
    engine = llm.llm_engine
    ids = tokenize_inputs(llm._tokenizer, texts, max_input_tokens(engine), truncate)
    count = sum(len(i) for i in ids)
    if per_token and token_states_wanted(llm, pooling):
        states = run_embeddings(steps, ids, EmbedParams(TOKEN_STATES))
        vectors = [[finish_vector(row, normalize, dimensions).tolist() for row in rows] for rows in states]
        return (vectors[0] if single else vectors), count
    # Llama(pooling_type=...) (llama.cpp's numbers, kept as pooling_type_arg by the constructor
    # once it takes llama-cpp-python's arguments) comes before the file's own pooling_type
    asked = POOLING_TYPES.get(getattr(llm, "pooling_type_arg", -1))
    params = EmbedParams(pooling or (asked if asked in POOLINGS else default_pooling(llm._model.config)))
    vectors = [finish_vector(v, normalize, dimensions).tolist() for v in run_embeddings(steps, ids, params)]
    return (vectors[0] if single else vectors), count
