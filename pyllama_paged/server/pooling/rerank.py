"""Reranking routes, as llama.cpp's server answers them when started with --rerank:
POST /v1/rerank (and its aliases /v1/reranking, /rerank, /reranking) and /api/rerank, one
shape for all. The request is Jina's and Cohere's: {model, query, documents: [str | {text}],
top_n, return_documents}, plus ours `truncate` (cut each document to fit the model's context;
without it an over-long pair is a 400). The answer: {model, object: "list", results: [{index,
relevance_score, document?}], usage: {prompt_tokens, total_tokens}}; see calls/rerank.py for
the order, top_n, return_documents and what a score means.

Every document of a request is its own engine request, all submitted together, so they run
as one batch (an encoder's padded batches, a decoder's shared steps). Errors are in the
route's shape (OpenAI's under /v1, Ollama's elsewhere): an unknown model is a 404; a model
that cannot rank, an empty query or document list, a bad top_n, too many documents
(Limits.max_embedding_inputs / max_embedding_chars), an over-long pair and a malformed
body are 400s that name the field."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from ...calls.embeddings import max_input_tokens
from ...calls.rerank import RerankJob, RerankRequestError, check_request, prepare_rerank, rerank_response
from ...calls.rerank_head import NotAReranker
from ...errors import PagedError
from .embeddings import holding, pooled_states
from ..generation import APIError, off_loop, refuse_over
from ..lookup import find_model
from ..state import server_state
from ..registry import ServedModel

ROUTES = ("/v1/rerank", "/api/rerank")
ALIASES = ("/v1/reranking", "/rerank", "/reranking")   # llama.cpp's other names, left out of the schema


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None                  # None: the first served model, as llama.cpp's one model
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None                  # None: every document
    return_documents: bool | None = False
    truncate: bool | None = False             # ours: cut documents to fit instead of refusing them


def _prepared(served: ServedModel, body: RerankRequest, texts: list[str]) -> RerankJob:
    """The request's engine inputs (on the prep pool: tokenizing, reading the head once)."""
    try:
        return prepare_rerank(served.model, served.tokenizer, served.template, max_input_tokens(served.loop.llm),
                              served.name, body.query, texts, bool(body.truncate))
    except NotAReranker as e:
        raise APIError(400, str(e), "model") from None
    except PagedError as e:   # a pair past the context, text the tokenizer refuses
        raise APIError(400, str(e), "documents") from None


router = APIRouter()


async def rerank(body: RerankRequest, request: Request):
    state = server_state(request)
    served = await find_model(state.registry, body.model)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    try:
        check_request(body.query, texts, body.top_n)
    except RerankRequestError as e:
        raise APIError(400, str(e), e.param) from None
    refuse_over(state.limits, "max_embedding_inputs", len(texts), "the number of documents", "documents")
    refuse_over(state.limits, "max_embedding_chars", len(body.query) + sum(len(t) for t in texts),
                "the total size of the query and documents", "documents")
    async with holding(state, served):
        job = await off_loop(state.prep, _prepared, served, body, texts)
        states = await pooled_states(served, job.inputs, job.params, "document")
    served.last_used = time.time()
    state.metrics.add_tokens(job.n_tokens, 0)
    return rerank_response(body.model or served.name, job.scores(states), texts, job.n_tokens, body.top_n,
                           bool(body.return_documents))

for _path in ROUTES + ALIASES:
    router.add_api_route(_path, rerank, methods=["POST"], include_in_schema=_path in ROUTES)
