"""A reranker's inputs: each (query, document) pair as the model's token ids, fitted to its
context (the document cut when truncate is set; otherwise an over-long pair is refused with
its size).

Cross-encoders read `[CLS] query [SEP] document [SEP]`, with token types 0 for the query's
part and 1 for the document's when the model embeds token types (BERT's sentence pairs, as
Hugging Face's tokenizers give them).

Decoder rerankers read a prompt; the first of these that applies:
1. the GGUF's `tokenizer.chat_template.rerank`, with `{query}` and `{document}` replaced
   (llama.cpp's convention; its converter writes Qwen3-Reranker's prompt there);
2. Qwen3-Reranker's prompt as its model card gives it, when the vocabulary has ChatML's
   `<|im_start|>` (a Qwen3-Reranker GGUF made without llama.cpp's template);
3. the model's own chat template rendering Qwen3-Reranker's system and user messages, with
   the generation prompt, so the next token is the answer.
The request's texts never become control tokens (they are escaped as chat messages are)."""

from __future__ import annotations

import re

from .rerank_head import RERANK_TEMPLATE_KEY
from ..tokenizer.chat_template import ChatPrompt, no_escape
from .embeddings import InputTooLong

QWEN3_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct '
                'provided. Note that the answer can only be "yes" or "no".')
QWEN3_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_TEMPLATE = (f"<|im_start|>system\n{QWEN3_SYSTEM}<|im_end|>\n<|im_start|>user\n<Instruct>: {QWEN3_INSTRUCT}\n"
                  "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
_PLACEHOLDER = re.compile(r"\{(query|document)\}")
_TRUNCATE_TRIES = 4   # a cut document can tokenize differently at the cut: re-measured a few times


def _too_long(index: int, size: int, limit: int) -> InputTooLong:
    return InputTooLong(f"document {index}: the query and document are {size} tokens; the model takes at most "
                        f"{limit} (set truncate to cut the document)")


def _query_too_long(size: int, limit: int) -> InputTooLong:
    return InputTooLong(f"the query alone takes {size} of the model's {limit} tokens: no room for a document")


class PairEncoder:
    """Token ids (and token types) of (query, document) pairs for one model."""

    def __init__(self, tokenizer, is_encoder: bool, n_token_types: int, metadata: dict, chat_template, limit: int):
        self.tokenizer, self.is_encoder, self.limit = tokenizer, is_encoder, limit
        self.segments = n_token_types > 1
        self.template = metadata.get(RERANK_TEMPLATE_KEY) or None
        if self.template is None and tokenizer.token_to_id("<|im_start|>") is not None:
            self.template = QWEN3_TEMPLATE
        self.chat_template = chat_template

    def encode(self, query: str, documents: list[str], truncate: bool) -> list[tuple[list[int], tuple | None]]:
        """(ids, token types or None) of each document's pair, in order."""
        if self.is_encoder:
            head = self.tokenizer.encode(query, add_special=True, parse_special=False)
            return [self._pair(head, doc, truncate, i) for i, doc in enumerate(documents)]
        return [(self._prompt_ids(query, doc, truncate, i), None) for i, doc in enumerate(documents)]

    # ---- cross-encoders -------------------------------------------------------------
    def _pair(self, head: list[int], document: str, truncate: bool, index: int) -> tuple[list[int], tuple | None]:
        tok = self.tokenizer
        body = tok.encode(document, add_special=False, parse_special=False)
        tail = [tok.eos_id] if tok.add_eos and tok.eos_id is not None else []   # the closing [SEP]
        room = self.limit - len(head) - len(tail)
        if len(body) > room:
            if not truncate:
                raise _too_long(index, len(head) + len(body) + len(tail), self.limit)
            if room < 1:
                raise _query_too_long(len(head) + len(tail), self.limit)
            body = body[:room]
        ids = head + body + tail
        types = (0,) * len(head) + (1,) * (len(body) + len(tail)) if self.segments else None
        return ids, types

    # ---- decoders ---------------------------------------------------------------------
    def render(self, query: str, document: str) -> ChatPrompt:
        """The decoder's prompt for one pair (see the module's docstring)."""
        if self.template is not None:
            template, values = self.template, {"query": query, "document": document}

            def fill(escape):
                return _PLACEHOLDER.sub(lambda m: escape(values[m.group(1)]), template)

            return ChatPrompt(fill(no_escape), fill)
        user = f"<Instruct>: {QWEN3_INSTRUCT}\n<Query>: {query}\n<Document>: {document}"
        return self.chat_template.render([{"role": "system", "content": QWEN3_SYSTEM},
                                          {"role": "user", "content": user}])

    def _prompt_ids(self, query: str, document: str, truncate: bool, index: int) -> list[int]:
        tok = self.tokenizer
        ids = tok.encode_chat(self.render(query, document))
        if len(ids) <= self.limit:
            return ids
        if not truncate:
            raise _too_long(index, len(ids), self.limit)
        body = tok.encode(document, add_special=False, parse_special=False)
        for _ in range(_TRUNCATE_TRIES):
            keep = len(body) - (len(ids) - self.limit)
            if keep < 1:
                raise _query_too_long(len(ids) - len(body), self.limit)
            body = body[:keep]
            ids = tok.encode_chat(self.render(query, tok.decode(body)))
            if len(ids) <= self.limit:
                return ids
        raise _too_long(index, len(ids), self.limit)
