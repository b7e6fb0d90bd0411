"""A reranker's scoring head, read from its GGUF in llama.cpp's layout and applied to the
pooled states the engine returns (NumPy in float64: a few small matrices per request).

Cross-encoders (`bert` with a classification head): the [CLS] token's final state goes
through `cls.weight`/`cls.bias` and tanh when the file has them (BERT's pooler dense), then
through `cls.output.weight`/`cls.output.bias` when it has them (the classifier), as
llama.cpp's rank pooling does. The relevance score is the first output, raw: a one-label
cross-encoder's logit, as llama.cpp's server reports it.

Decoder rerankers (Qwen3-Reranker style): the last token's final normed state projected on
the two answer rows, softmax, P("yes"). The rows are `cls.output.weight` when the file has
them (llama.cpp's converter stores the lm_head rows of "yes" and "no" there, labelled by
`<arch>.classifier.output_labels`), otherwise the output head's rows of the "yes" and "no"
tokens with the model's final logit softcapping: exactly the two logits the full head would
give, without computing the rest of the vocabulary (which is why a decoder reranker runs as
a "last"-pooled embedding request rather than a prompt-scoring one)."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from ..errors import RequestError
from ..engine import Model

# the answer tokens' spellings tried in order: bare (BPE "yes", or an SPM piece after a
# newline), SentencePiece's and GPT-2's word-initial forms
_ANSWER_PIECES = {"yes": ("yes", "\u2581yes", "\u0120yes"), "no": ("no", "\u2581no", "\u0120no")}
RERANK_TEMPLATE_KEY = "tokenizer.chat_template.rerank"   # llama.cpp's: {query} and {document} in it


class NotAReranker(RequestError):
    """The model has no way to score a (query, document) pair."""


@dataclass(frozen=True)
class RankHead:
    """The layers from a pooled state to a relevance score (see the module's docstring)."""

    pooling: str                        # which token's state the head reads: "cls" or "last"
    dense: np.ndarray | None = None     # [hidden, n_embd], then tanh
    dense_bias: np.ndarray | None = None
    out: np.ndarray | None = None       # [n_out, hidden]
    out_bias: np.ndarray | None = None
    softmax: bool = False               # scores are probabilities over the outputs
    softcap: float = 0.0                # the model's final logit softcapping (token rows only)
    index: int = 0                      # the output that is the relevance score

    def scores(self, states: np.ndarray) -> np.ndarray:
        """Relevance scores [n] of pooled states [n, n_embd]."""
        x = np.asarray(states, dtype=np.float64)
        if self.dense is not None:
            x = x @ self.dense.T
            if self.dense_bias is not None:
                x = x + self.dense_bias
            x = np.tanh(x)
        if self.out is not None:
            x = x @ self.out.T
            if self.out_bias is not None:
                x = x + self.out_bias
        if self.softcap > 0:
            x = self.softcap * np.tanh(x / self.softcap)
        if self.softmax and x.shape[1] > 1:
            x = np.exp(x - x.max(axis=1, keepdims=True))
            x = x / x.sum(axis=1, keepdims=True)
        return x[:, self.index]


def _info(model: Model, name: str):
    return next((t for t in model.gguf.tensors if t.name == name), None)


def read_tensor(model: Model, name: str, rows=None) -> np.ndarray | None:
    """A tensor of the file dequantized to float64 in NumPy's order ([rows, row length]; a
    vector stays 1-D), or only the given rows; None when the file has no such tensor."""
    info = _info(model, name)
    if info is None:
        return None
    qtype = GGMLQuantizationType(info.type)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = model.gguf.tensor_bytes(info).reshape(-1, info.shape[0] // block * type_size)
    if rows is not None:
        raw = raw[list(rows)]
    values = dequantize(np.ascontiguousarray(raw), qtype).astype(np.float64)
    return values[0] if len(info.shape) == 1 else values


def declared_reranker(model: Model) -> bool:
    """Whether the GGUF says it ranks: an encoder with a classification head; a decoder with
    rank pooling (<arch>.pooling_type 4), a rerank template or a cls.output head."""
    heads = _info(model, "cls.output.weight") is not None or _info(model, "cls.weight") is not None
    if model.config.is_encoder:
        return heads
    return heads or model.config.pooling == "rank" or bool(model.metadata.get(RERANK_TEMPLATE_KEY))


def not_a_reranker(name: str, model: Model) -> NotAReranker:
    """The error that says why a model cannot rerank."""
    if model.config.is_encoder:
        return NotAReranker(f"model '{name}' is an embedding model without a classification head (no "
                            "cls.weight or cls.output.weight tensor): it cannot rerank; serve a cross-encoder "
                            "(e.g. a BertForSequenceClassification checkpoint converted by "
                            "pyllama_paged.convert.bert_gguf)")
    return NotAReranker(f"model '{name}' is not a reranker: its GGUF declares no rank pooling "
                        f"({model.config.arch}.pooling_type 4), no {RERANK_TEMPLATE_KEY} template and no "
                        "cls.output head (a Qwen3-Reranker GGUF from llama.cpp's converter has all three)")


def _encoder_head(model: Model) -> RankHead:
    return RankHead("cls", read_tensor(model, "cls.weight"), read_tensor(model, "cls.bias"),
                    read_tensor(model, "cls.output.weight"), read_tensor(model, "cls.output.bias"))


def _answer_id(tokenizer, word: str) -> int:
    for piece in _ANSWER_PIECES[word]:
        token = tokenizer.token_to_id(piece)
        if token is not None:
            return token
    raise NotAReranker(f"the vocabulary has no '{word}' token for a yes/no reranker to score")


def _decoder_head(model: Model, tokenizer) -> RankHead:
    out = read_tensor(model, "cls.output.weight")
    if out is not None:
        labels = model.metadata.get(f"{model.config.arch}.classifier.output_labels") or []
        index = labels.index("yes") if "yes" in labels else 0
        return RankHead("last", out=out, out_bias=read_tensor(model, "cls.output.bias"), softmax=True, index=index)
    ids = [_answer_id(tokenizer, "yes"), _answer_id(tokenizer, "no")]
    # the output head, or the token embeddings it is tied to when the file has none
    rows = read_tensor(model, "output.weight", ids)
    if rows is None:
        rows = read_tensor(model, "token_embd.weight", ids)
    return RankHead("last", out=rows, softmax=True, softcap=model.config.final_logit_softcap)


_heads: "weakref.WeakKeyDictionary[Model, RankHead]" = weakref.WeakKeyDictionary()
_heads_lock = threading.Lock()


def rank_head(model: Model, tokenizer) -> RankHead:
    """The model's scoring head (read once per loaded model); NotAReranker when an encoder has
    no classification head or a decoder's vocabulary has no yes/no tokens."""
    with _heads_lock:
        head = _heads.get(model)
    if head is None:
        if model.config.is_encoder:
            if not declared_reranker(model):
                raise not_a_reranker(model.path, model)
            head = _encoder_head(model)
        else:
            head = _decoder_head(model, tokenizer)
        with _heads_lock:
            _heads[model] = head
    return head
