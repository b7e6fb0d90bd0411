"""Reranking as the APIs give it: a query and its documents checked, each pair made the
model's input (rerank_inputs.py), every pair submitted to the engine at once as a pooled
request (an encoder runs them as a few padded batches, a decoder's scheduler prefills them
side by side), the pooled states scored by the model's head (rerank_head.py), then
ordered and shaped as llama.cpp's server answers /v1/rerank (Jina's and Cohere's shape).

Results: highest relevance_score first (equal scores keep the documents' order); top_n
(None: all; at least 1) keeps the first n; return_documents (default false, as Cohere's v2
and llama.cpp's Jina-shaped answer) adds each document as {"text": ...}. A cross-encoder's
score is its raw logit, a decoder reranker's P("yes") in [0, 1], as llama.cpp's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine import EmbedParams
from .rerank_head import RankHead, declared_reranker, not_a_reranker, rank_head
from ..errors import RequestError
from .embeddings import max_input_tokens, run_embeddings
from .rerank_inputs import PairEncoder

LLAMA_POOLING_TYPE_RANK = 4   # Llama(pooling_type=4) makes any decoder a yes/no reranker


class RerankRequestError(RequestError):
    """A request that cannot be ranked as asked; param names its field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def document_text(document, index: int) -> str:
    """A document as Jina and Cohere accept it: a string, or an object with a string "text"."""
    if isinstance(document, str):
        return document
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        return document["text"]
    raise RerankRequestError(f"documents[{index}] must be a string or an object with a string 'text'", "documents")


def check_request(query, documents, top_n) -> None:
    """RerankRequestError naming the field of a request that cannot be ranked."""
    if not isinstance(query, str) or not query:
        raise RerankRequestError("query is empty: give the text to rank the documents against", "query")
    if not documents:
        raise RerankRequestError("documents is empty: give at least one document to rank", "documents")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise RerankRequestError(f"top_n must be a positive integer, got {top_n!r}", "top_n")


@dataclass
class RerankJob:
    """One request's distinct pairs as engine inputs, and the head that scores their pooled states.

    A document given twice is encoded and scored once: the same pair must get the same score
    (a batch's rows may differ in their last bits), and the work is not worth doing twice."""

    head: RankHead
    inputs: list[list[int]]
    params: list[EmbedParams]
    rows: list[int]   # each document's row in inputs
    n_tokens: int     # the tokens of every pair, repeats included (the usage both APIs report)

    def scores(self, states: list[np.ndarray]) -> np.ndarray:
        """The relevance score of each document from the pooled states of the distinct pairs."""
        return self.head.scores(np.stack(states))[self.rows]


def prepare_rerank(model, tokenizer, chat_template, limit: int, name: str, query: str, texts: list[str],
                   truncate: bool, force: bool = False) -> RerankJob:
    """The engine inputs of ranking texts against query on a loaded model; NotAReranker (a
    RequestError) when the model cannot rank, InputTooLong for a pair past limit tokens."""
    if not (force or declared_reranker(model)):
        raise not_a_reranker(name, model)
    head = rank_head(model, tokenizer)
    encoder = model.config.is_encoder
    pairs = PairEncoder(tokenizer, encoder, model.n_token_types if encoder else 1, model.metadata,
                        chat_template, limit).encode(query, texts, truncate)
    distinct: dict[tuple, int] = {}
    inputs, params, rows = [], [], []
    for ids, types in pairs:
        key = (tuple(ids), tuple(types) if types is not None else None)
        if key not in distinct:
            distinct[key] = len(inputs)
            inputs.append(ids)
            params.append(EmbedParams(head.pooling, types))
        rows.append(distinct[key])
    return RerankJob(head, inputs, params, rows, sum(len(ids) for ids, _ in pairs))


def rerank_response(name: str, scores: np.ndarray, texts: list[str], n_tokens: int, top_n: int | None,
                    return_documents: bool) -> dict:
    """llama.cpp's /v1/rerank answer: results best first, cut to top_n, with usage."""
    order = sorted(range(len(texts)), key=lambda i: -float(scores[i]))   # stable: ties keep their order
    results = []
    for i in order[:top_n]:
        item = {"index": i, "relevance_score": float(scores[i])}
        if return_documents:
            item["document"] = {"text": texts[i]}
        results.append(item)
    return {"model": name, "object": "list", "results": results,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


def rerank_for_llama(llm, query: str, documents, top_n: int | None, return_documents: bool,
                     truncate: bool) -> dict:
    """Llama.rerank's work: every pair through the engine in one batch, then the answer."""
    documents = list(documents)
    check_request(query, documents, top_n)
    texts = [document_text(d, i) for i, d in enumerate(documents)]
    engine = llm.llm_engine
    job = prepare_rerank(llm._model, llm._tokenizer, llm.chat_template, max_input_tokens(engine), llm.model_path,
                         query, texts, truncate, force=llm.pooling_type_arg == LLAMA_POOLING_TYPE_RANK)
    states = run_embeddings(llm._shared_steps(), job.inputs, job.params)
    return rerank_response(llm.model_path, job.scores(states), texts, job.n_tokens, top_n, return_documents)
