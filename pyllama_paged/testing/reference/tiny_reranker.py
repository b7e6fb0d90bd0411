"""Tiny random decoder rerankers (Qwen3-Reranker style) in llama.cpp's layout, and their
float64 reference scores, for the reranking tests.

`head="cls_output"` writes what llama.cpp's converter writes for Qwen3-Reranker: rank
pooling, `<arch>.classifier.output_labels` ["yes", "no"], a `tokenizer.chat_template.rerank`
prompt with {query} and {document}, and a `cls.output.weight` of two rows. `head="tokens"`
writes rank pooling alone: the score then comes from the output head's "yes" and "no" rows
(both are whole tokens of the vocabulary either way)."""

from __future__ import annotations

import os

import gguf
import numpy as np

from .numpy_model import ReferenceModel
from .tiny_gguf import write_tiny_model

TEMPLATE = "<Query>: {query}\n<Document>: {document}\nRelevant:"
ANSWERS = ("yes", "no")


def write_tiny_decoder_reranker(path: str | os.PathLike, arch: str = "qwen3", head: str = "cls_output",
                                **options) -> str:
    """A tiny decoder reranker GGUF at path (write_tiny_model's options pass through)."""
    if head not in ("cls_output", "tokens"):
        raise ValueError(f"head must be 'cls_output' or 'tokens', not {head!r}")

    def extend(writer: gguf.GGUFWriter, rng: np.random.Generator) -> None:
        writer.add_pooling_type(gguf.PoolingType.RANK)
        if head == "cls_output":
            n_embd = options.get("n_embd") or 256
            writer.add_classifier_output_labels(list(ANSWERS))
            writer.add_string("tokenizer.chat_template.rerank", TEMPLATE)
            rows = rng.standard_normal((2, n_embd), dtype=np.float32) * np.float32(2.0 / np.sqrt(n_embd))
            writer.add_tensor("cls.output.weight", rows)

    return write_tiny_model(path, arch, extra_pieces=ANSWERS, extend=extend, **options)


def reference_score(model: ReferenceModel, ids: list[int]) -> float:
    """P("yes") of one prompt by the float64 reference: the cls.output rows on the last
    normed state when the file has them, else the full head's logits at "yes" and "no"."""
    logits = model.forward(ids)[-1]
    rows = model.tensors.get("cls.output.weight")
    if rows is not None:
        pair = model.last_hidden[-1] @ rows.astype(np.float64).T
    else:
        pair = logits[[model.token_id(a) for a in ANSWERS]]
    pair = np.exp(pair - pair.max())
    return float(pair[0] / pair.sum())
