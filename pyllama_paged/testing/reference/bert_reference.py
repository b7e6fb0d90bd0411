"""An independent NumPy BERT forward (float64) over Hugging Face BertModel weights
(the names in model.safetensors), for checking the GGML encoder graph and the
GGUF conversion together: embeddings + token types + positions, layer norm,
post-norm blocks of bidirectional attention and an exact-GELU FFN, then
masked pooling; and a cross-encoder's score (BertForSequenceClassification: the pooler's
tanh dense layer over [CLS], then the classifier)."""

from __future__ import annotations

import math

import numpy as np


def _layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _gelu(x):
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def bert_states(weights: dict, config: dict, ids: list[int], types: list[int] | None = None) -> np.ndarray:
    """Last-layer states [len(ids), hidden] of one input (token types: 0 everywhere when None)."""
    w = {k.removeprefix("bert."): np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    eps = config.get("layer_norm_eps", 1e-12)
    n_head = config["num_attention_heads"]
    n = len(ids)
    types = [0] * n if types is None else list(types)
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][types] \
        + w["embeddings.position_embeddings.weight"][:n]
    x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    for il in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{il}."

        def linear(name, h):
            return h @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        q, k, v = (linear(f"attention.self.{m}", x) for m in ("query", "key", "value"))
        hd = q.shape[1] // n_head
        q, k, v = (t.reshape(n, n_head, hd).transpose(1, 0, 2) for t in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v
        attn = attn.transpose(1, 0, 2).reshape(n, -1)
        x = _layer_norm(x + linear("attention.output.dense", attn), w[p + "attention.output.LayerNorm.weight"],
                        w[p + "attention.output.LayerNorm.bias"], eps)
        h = linear("output.dense", _gelu(linear("intermediate.dense", x)))
        x = _layer_norm(x + h, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    return x


def bert_embedding(weights: dict, config: dict, ids: list[int], pooling: str = "mean",
                   normalize: bool = True) -> np.ndarray:
    """One input's pooled (and by default L2-normalized) embedding."""
    states = bert_states(weights, config, ids)
    vec = {"mean": states.mean(0), "cls": states[0], "last": states[-1]}[pooling]
    return vec / np.linalg.norm(vec) if normalize else vec


def cross_encoder_logits(weights: dict, config: dict, ids: list[int], types: list[int]) -> np.ndarray:
    """A BertForSequenceClassification's logits [n_labels] for one text pair's ids and types."""
    cls = bert_states(weights, config, ids, types)[0]
    pooled = np.tanh(cls @ np.asarray(weights["bert.pooler.dense.weight"], np.float64).T
                     + weights["bert.pooler.dense.bias"])
    return pooled @ np.asarray(weights["classifier.weight"], np.float64).T + weights["classifier.bias"]
