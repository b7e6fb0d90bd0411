"""pyllama_paged/testing/synthetic_presets.py and synthetic_gguf.py: every preset, shrunk to two
layers (same architecture, vocabulary, tokenizer and type mix), loads in the engine, turns a
chat into the family's markup and generates; its tensors are llama.cpp's Q4_K_M mix (gpt-oss:
its release's, MXFP4 experts and Q8_0 elsewhere)."""

import dataclasses

import numpy as np
import pytest

from pyllama_paged.gguf.reader import GGUFFile
from pyllama_paged.testing import synthetic_gguf, synthetic_presets

# the control tokens each family's chat markup is made of, and its BOS (None: none is added)
MARKUP = {
    "llama3": (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>"),
    "qwen2": (["<|im_start|>", "<|im_end|>"], None),
    "source": (["<start_of_turn>", "<end_of_turn>"], "<bos>"),
    "gpt-oss": (["<|start|>", "<|message|>", "<|end|>"], None),
    "qwen35": (["<|im_start|>", "<|im_end|>"], None),
}
GGML_Q4_K, GGML_Q6_K, GGML_F32, GGML_Q8_0, GGML_MXFP4 = 12, 14, 0, 8, 39
# how long each family's chat prompt for MESSAGES may be (harmony's template says more)
PROMPT_TOKENS = {"gpt-oss": 90}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=list(synthetic_presets.PRESETS))
def small(request, tmp_path_factory):
    preset = synthetic_presets.shrink(synthetic_presets.get(request.param))
    path = tmp_path_factory.mktemp("presets") / preset.file_name
    return preset, synthetic_gguf.write(path, preset, seed=5)


def test_shrinking_keeps_what_tests_can_check(small):
    preset, info = small
    full = synthetic_presets.get(preset.name.removesuffix("-small"))
    assert (preset.arch, preset.tokenizer, preset.n_vocab, preset.head_dim, preset.tied) == \
           (full.arch, full.tokenizer, full.n_vocab, full.head_dim, full.tied)
    assert preset.n_head // preset.n_head_kv == full.n_head // full.n_head_kv
    # gemma4: a sliding and a full layer, twice where the second pair reads the first's KV
    assert info["n_layer"] == (4 if full.n_kv_shared else 2) and info["n_embd"] % 256 == 0 and info["n_ff"] == 512
    assert (preset.head_dim_swa, preset.k_eq_v, bool(preset.n_kv_shared), bool(preset.n_embd_per_layer)) == \
           (full.head_dim_swa, full.k_eq_v, bool(full.n_kv_shared), bool(full.n_embd_per_layer))
    if full.hybrid:   # a linear layer, then a full-attention one
        assert preset.full_attention_interval == 2 and preset.ssm_d_state == full.ssm_d_state
        assert preset.ssm_dt_rank // preset.ssm_n_group == full.ssm_dt_rank // full.ssm_n_group
    assert info["n_vocab"] == (full.n_vocab or 262144)


def test_the_type_mix_is_q4_k_m(small):
    preset, info = small
    types = {t.name: t.type for t in GGUFFile(info["path"]).tensors}
    if preset.type_mix == "mxfp4":
        return _check_the_mxfp4_mix(types)
    # the head in Q6_K: the embedding when tied, else output.weight (the embedding then in Q4_K)
    head = "token_embd.weight" if preset.tied else "output.weight"
    assert ("output.weight" in types) == (not preset.tied) and types[head] == GGML_Q6_K
    # the layers Q4_K_M gives more bits (two layers: layer 1, the last eighth) keep attn_v (a
    # hybrid's attn_qkv with it) and ffn_down(_exps, _shexp) in Q6_K; an expert router, the shared
    # expert's gate row, the linear layers' kernel, decay and bias, norms, biases and scales are
    # never quantized; rows that are not whole K-quant blocks (gemma4's per-layer projection)
    # fall back to Q8_0
    for name, ttype in types.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", ".bias", "rope_freqs.weight",
                          "ffn_gate_inp.weight", ".scale", "layer_output_scale.weight",
                          "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight", ".ssm_a")):
            assert ttype == GGML_F32, name
        elif name.endswith(".proj.weight") and preset.arch == "gemma4":
            assert ttype == GGML_Q8_0, name
        elif synthetic_gguf.more_bits(layer, info["n_layer"]) and \
                name.endswith(("attn_v.weight", "attn_qkv.weight", "ffn_down.weight", "ffn_down_exps.weight",
                               "ffn_down_shexp.weight")):
            assert ttype == GGML_Q6_K, name
        elif name != head:
            assert ttype == GGML_Q4_K, name
    gemma = preset.arch in ("gemma3", "gemma4")
    assert ("blk.0.attn_q.bias" in types) == (preset.arch == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in types) == (gemma or preset.arch == "qwen3moe")
    assert ("blk.0.post_ffw_norm.weight" in types) == gemma
    # gemma4 runs its dense FFN beside the experts, whose gate and up are one tensor
    experts = "blk.0.ffn_gate_up_exps.weight" if preset.arch == "gemma4" else "blk.0.ffn_up_exps.weight"
    assert (experts in types) == (preset.n_expert > 0)
    assert ("blk.0.ffn_up.weight" not in types) == (preset.n_expert > 0 and preset.arch != "gemma4")
    assert ("rope_freqs.weight" in types) == (preset.llama3_rope or preset.arch == "gemma4")


def _check_the_mxfp4_mix(types):
    """gpt-oss's release: MXFP4 experts, Q8_0 for every other matrix, f32 for the rest."""
    for name, ttype in types.items():
        if name.endswith("_exps.weight"):
            assert ttype == GGML_MXFP4, name
        elif name.endswith((".bias", "norm.weight", "attn_sinks.weight", "ffn_gate_inp.weight")):
            assert ttype == GGML_F32, name
        else:
            assert ttype == GGML_Q8_0, name
    assert {"blk.1.attn_sinks.weight", "blk.1.attn_output.bias", "blk.1.ffn_down_exps.bias",
            "blk.1.post_attention_norm.weight", "output.weight"} <= set(types)
    assert "blk.0.ffn_norm.weight" not in types


def test_the_engine_tokenizes_a_chat_and_generates(small):
    from pyllama_paged import Llama

    preset, info = small
    llm = Llama(model_path=info["path"], paged=True, n_ctx=256, n_threads=2, verbose=False)
    markup, bos = MARKUP[preset.tokenizer]

    def one_id(text):
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert len(ids) == 1, text
        return ids[0]

    ids = llm.tokenize(str(llm.chat_template.render(MESSAGES)).encode(), special=True)
    assert all(one_id(t) in ids for t in markup)
    assert ids[0] == one_id(bos or markup[0])   # BOS where the family adds one, else the markup
    # the words are whole tokens: the prompt is about as long as a real one
    assert len(ids) < PROMPT_TOKENS.get(preset.tokenizer, 45)
    out = llm.create_chat_completion(MESSAGES, max_tokens=4, temperature=0)
    assert out["usage"]["prompt_tokens"] == len(ids) and 1 <= out["usage"]["completion_tokens"] <= 4
    seq = llm.runner.add_sequence(ids)
    logits = np.asarray(llm.runner.prefill(seq))
    assert logits.shape == (info["n_vocab"],) and np.isfinite(logits).all() and logits.std() > 0.5


def test_an_untied_head_is_q6_k_and_the_embedding_q4_k(tmp_path):
    from pyllama_paged import Llama

    preset = dataclasses.replace(synthetic_presets.shrink(synthetic_presets.get("llama3.2-1b")), tied=False)
    info = synthetic_gguf.write(tmp_path / "untied.gguf", preset)
    types = {t.name: t.type for t in GGUFFile(info["path"]).tensors}
    assert (types["output.weight"], types["token_embd.weight"]) == (GGML_Q6_K, GGML_Q4_K)
    llm = Llama(model_path=info["path"], paged=True, n_ctx=128, n_threads=2, verbose=False)
    assert llm("Hello", max_tokens=2, temperature=0)["usage"]["completion_tokens"] >= 1


def test_shapes_that_are_not_whole_k_quant_blocks_are_refused(tmp_path):
    with pytest.raises(ValueError, match="multiple of 256"):
        synthetic_gguf.write(tmp_path / "x.gguf", "qwen2.5-1.5b", n_ff=1000)
    with pytest.raises(ValueError, match="unknown preset"):
        synthetic_presets.get("llama4")
