"""GGUF loader fuzzing (pyllama_paged/testing/gguf_fuzz.py): a fixed corpus of the bugs the
fuzzer found, then a deterministic random budget. Cases run in worker
subprocesses, so a regression that crashes the loader fails a test instead of
killing pytest. Every case must open cleanly or raise the project's own error.
"""

import re

import pytest

from pyllama_paged.testing import gguf_fuzz
from pyllama_paged.testing.gguf_mutate import ARRAY, BOOL, F32, I32, STRING, U32, U64

L, G, Q2, Q3 = "llama-q8_0", "gemma3-f16", "qwen2-q4_0", "qwen3-q4_k-bpe"

# (seed, operations, regex the ModelLoadError must match). The comment says what
# the unfixed code did with the file.
CORPUS = [
    # -- header and counts: a huge count is refused before anything is allocated
    (L, [["counts", None, 2**63]], r"metadata field count is \d+, but only \d+ bytes follow"),
    (L, [["counts", 2**40, None]], r"tensor count is \d+, but only \d+ bytes follow"),
    (L, [["field", "arr_count", 0, 2**62]], r"tokenizer.ggml.tokens': array length is \d+"),  # (tokenizer reader: struct.error)
    (L, [["field", "arr_count", 1, 2**62]], r"tokenizer.ggml.scores': array length is \d+"),
    (L, [["field", "str_len", 3, 2**31]], r"truncated while reading"),  # (tokenizer reader: struct.error)
    (L, [["truncate", 9000]], r"truncated"),  # mid-array (tokenizer reader: "buffer size must be a multiple")
    (L, [["kv_unknown_type", "general.name", 13]], r"unknown value type 13"),  # (tokenizer reader: ValueError)
    (L, [["header", None, 4]], r"GGUF version 4 unsupported"),  # (tokenizer reader: ValueError)
    (L, [["kv_dup", "llama.block_count"]], r"'llama.block_count' appears twice"),  # (the last value won)
    # -- general.alignment
    (L, [["kv", "general.alignment", U32, 0]], r"alignment' must be a power of two, got 0"),  # (ZeroDivisionError)
    (L, [["kv", "general.alignment", U32, 3]], r"must be a power of two, got 3"),  # (accepted)
    (L, [["kv", "general.alignment", STRING, "llama"]], r"must be a power of two"),  # (ValueError from int())
    (L, [["kv", "general.alignment", ARRAY, {"etype": U32, "items": [32, 32]}]], r"must be a power of two"),  # (TypeError)
    # -- hyper-parameters: typed and range-checked before use
    (L, [["kv", "general.architecture", ARRAY, {"etype": U32, "items": [1]}]],
     r"'general.architecture' must be a string"),  # (TypeError: unhashable)
    (L, [["kv", "llama.block_count", U64, 2**40]], r"'llama.block_count' is \d+, outside \[1, 512\]"),  # (MemoryError)
    (L, [["kv", "llama.block_count", U64, 2**63 - 1]], r"outside \[1, 512\]"),  # (OverflowError)
    (L, [["kv", "llama.embedding_length", STRING, "llama"]], r"embedding_length' must be an integer"),  # (ValueError)
    (L, [["kv", "llama.attention.head_count", ARRAY, {"etype": U32, "items": []}]],
     r"head_count' must be an integer, got an array"),  # (TypeError)
    (L, [["kv", "llama.context_length", F32, "inf"]], r"context_length' must be an integer"),  # (OverflowError)
    (L, [["kv", "llama.context_length", U32, 2**32 - 1]], r"context_length' is \d+, outside"),  # (cffi OverflowError)
    (G, [["kv", "gemma3.embedding_length", I32, -32]], r"embedding_length' is -32, outside"),  # (math domain error)
    (Q2, [["kv", "qwen2.attention.key_length", I32, -31314]], r"key_length' is -31314, outside"),  # (cffi OverflowError)
    (G, [["kv", "gemma3.attention.query_pre_attn_scalar", F32, -1.0]],
     r"query_pre_attn_scalar' is -1.0"),  # (math domain error)
    (G, [["kv", "gemma3.attention.sliding_window", U64, 2**32]], r"sliding_window' is \d+, outside"),  # (cffi OverflowError)
    (L, [["kv", "llama.rope.freq_base", STRING, "default"]], r"freq_base' must be a number"),  # (ValueError from float())
    (L, [["kv", "llama.rope.scaling.factor", ARRAY, {"etype": F32, "items": [1.0, 2.0]}]],
     r"scaling.factor' must be a number"),  # (ValueError: truth value of an array)
    # -- tokenizer metadata
    (L, [["kv", "tokenizer.ggml.tokens", U32, 511]], r"tokenizer.ggml.tokens' must be an array of strings"),  # (TypeError)
    (L, [["array_resize", "tokenizer.ggml.scores", 3]], r"tokenizer.ggml.scores' has 3 entries for \d+ tokens"),  # (ValueError)
    (L, [["kv", "tokenizer.ggml.scores", F32, 1.0]], r"scores' must be an array of numbers"),  # (TypeError)
    (L, [["kv", "tokenizer.ggml.token_type", ARRAY, {"etype": STRING, "items": ["a"]}]],
     r"token_type' must be an array of integers"),  # (ValueError from int())
    (L, [["kv", "tokenizer.ggml.bos_token_id", STRING, "none"]], r"bos_token_id' must be an integer"),  # (ValueError)
    (L, [["kv", "tokenizer.ggml.eos_token_id", F32, "inf"]], r"eos_token_id' must be an integer"),  # (OverflowError)
    (L, [["kv", "tokenizer.ggml.add_bos_token", ARRAY, {"etype": U32, "items": [1, 2]}]],
     r"add_bos_token' must be a boolean"),  # (ValueError: truth value of an array)
    (L, [["kv_drop", "tokenizer.ggml.model"]], r"no tokenizer.ggml.model"),  # (ValueError)
    (L, [["kv", "tokenizer.ggml.model", BOOL, True]], r"tokenizer model True is not supported"),  # (NotImplementedError)
    (Q2, [["kv", "tokenizer.ggml.model", ARRAY, {"etype": F32, "items": [2.0, 1.0]}]],
     r"is not supported"),  # (ValueError: truth value of an array)
    (Q3, [["kv", "tokenizer.ggml.merges", U32, 3]], r"merges' must be an array of strings"),  # (TypeError)
    (Q3, [["kv", "tokenizer.ggml.pre", ARRAY, {"etype": STRING, "items": ["qwen2"]}]],
     r"tokenizer.ggml.pre' must be a string"),  # (TypeError: unhashable)
    (G, [["kv", "tokenizer.chat_template", U32, 5]], r"chat_template' must be a string"),  # (TypeError in jinja)
    (G, [["kv", "tokenizer.chat_template", STRING, "{% if %}"]], r"chat_template' does not parse"),  # (TemplateSyntaxError)
    # -- tensor infos
    (L, [["tensor", "output_norm.weight", "dims", [0, 2**63]]], r"does not fit GGML's 64-bit sizes"),  # (cffi OverflowError)
    (L, [["tensor", "blk.0.attn_q.weight", "dims", [32, 2**62, 4]]], r"does not fit GGML's 64-bit sizes"),
    (L, [["tensor", "output_norm.weight", "dims", [32, 0]]],
     r"shape \[32, 0\] but the hyper-parameters need \[32, 1\]"),  # (loaded; GGML read 128 bytes past a 0-byte tensor)
    (L, [["tensor", "output_norm.weight", "offset_add", 1]], r"not a multiple of the file's alignment 32"),  # (loaded)
    (L, [["tensor", "output_norm.weight", "name", {"hex": "6f75747075745f6e6f726d00"}]], r"contains a NUL byte"),
    (L, [["tensor_dup", "output_norm.weight"]], r"tensor 'output_norm.weight' appears twice"),
    (L, [["tensor", "output_norm.weight", "dims", [32, 1, 1, 1, 1]]], r"has 5 dimensions"),
    # -- weight types GGML stores but cannot compute with: the first forward died
    (L, [["tensor", "blk.0.attn_norm.weight", "ttype", 1]], r"norm weights and biases must be f32"),  # (SIGABRT)
    (G, [["tensor", "blk.0.post_ffw_norm.weight", "ttype", 9]], r"must be f32"),  # (SIGABRT)
    (Q2, [["tensor", "blk.0.attn_q.bias", "ttype", 28]], r"must be f32"),  # (SIGABRT)
    (L, [["tensor", "blk.0.attn_q.weight", "ttype", 26]], r"type i32 has no CPU matrix multiplication"),  # (SIGSEGV)
    (L, [["tensor", "blk.0.ffn_gate.weight", "ttype", 9]], r"type q8_1 has no CPU matrix multiplication"),  # (SIGSEGV)
    (G, [["tensor", "blk.0.attn_v.weight", "ttype", 28]], r"type f64 has no CPU matrix multiplication"),  # (SIGSEGV)
    # -- still fine: a file may be odd without being wrong
    (L, [["kv", "general.alignment", U32, 32]], None),
    (L, [["kv", "tokenizer.ggml.bos_token_id", U32, 10**6]], None),  # out-of-range ids count as absent
    (Q3, [["kv", "tokenizer.ggml.pre", STRING, "no-such-pre-tokenizer"]], None),  # default regexes, a warning
]


def _bad(summary):
    return summary["crashes"] + summary["hangs"] + summary["wrong_exceptions"]


def test_regression_corpus():
    recipes = [{"seed": seed, "ops": ops} for seed, ops, _ in CORPUS]
    summary = gguf_fuzz.run_fuzz(len(recipes), 0, workers=2, recipes=recipes)
    assert summary["cases"] == len(CORPUS)
    results = {f["case"]: f for f in summary["failures"]}
    assert not results, results
    outcomes = summary["outcomes"]
    for i, (seed, ops, pattern) in enumerate(CORPUS):
        res = outcomes[i]
        if pattern is None:
            assert res["outcome"] == "ok", (seed, ops, res)
        else:
            assert res["outcome"] == "error" and res["type"] == "ModelLoadError", (seed, ops, res)
            assert re.search(pattern, res["message"]), (seed, ops, res["message"])


def test_random_budget():
    """4000 deterministic random cases: none may crash, hang or raise a foreign type."""
    summary = gguf_fuzz.run_fuzz(4000, 0, workers=2)
    assert summary["cases"] == 4000
    assert _bad(summary) == 0, summary["failures"][:5]
    # The mutations must reach both outcomes and many different checks, or the
    # budget proves little.
    assert summary["ok_loads"] > 100 and summary["clean_errors"] > 1000
    assert summary["distinct_error_kinds"] > 50


@pytest.mark.slow
def test_random_budget_long():
    summary = gguf_fuzz.run_fuzz(20000, 1, workers=2)
    assert _bad(summary) == 0, summary["failures"][:5]
