"""pyllama_paged/testing/synthetic_gguf.py: the random-weight Gemma 3 GGUF that benchmarks use as a
realistically sized model. Checked small: its blocks decode to the intended values, the
Q4_K_M type mix is llama.cpp's, and the engine runs it with the real tokenizer."""

import gguf
import numpy as np
import pytest

from pyllama_paged.testing import synthetic_gguf

SHAPE = dict(n_embd=256, n_layer=8, n_head=2, n_head_kv=1, n_ff=512)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic") / "small.gguf"
    return synthetic_gguf.write(path, **SHAPE, seed=3)


@pytest.fixture(scope="module")
def tensors(model):
    return {t.name: t for t in gguf.GGUFReader(model["path"]).tensors}   # parsing the vocabulary takes seconds


def test_blocks_decode_to_centred_values_of_the_intended_spread(model, tensors):
    for name, want_std in (("token_embd.weight", 0.5 / 16), ("blk.0.attn_q.weight", 1 / 16),
                           ("blk.0.ffn_down.weight", 1 / np.sqrt(512)), ("blk.3.ffn_down.weight", 1 / np.sqrt(512))):
        t = tensors[name]
        x = gguf.quants.dequantize(t.data[:4096], t.tensor_type)   # the embedding's first rows will do
        assert x.std() == pytest.approx(want_std, rel=0.1), name
        assert abs(x.mean()) < 0.1 * want_std, name
    assert sum(int(np.prod(t.shape)) for t in tensors.values()) == model["n_params"]


def test_the_type_mix_is_q4_k_m(tensors):
    types = {name: t.tensor_type.name for name, t in tensors.items()}
    assert types["token_embd.weight"] == "Q6_K"
    assert types["blk.0.attn_q.weight"] == "Q4_K"
    # 8 layers: layer 0 (first eighth), layer 7 (last eighth) and layer 3 ((3 - 1) % 3 == 2) get Q6_K
    q6 = {il for il in range(8) if types[f"blk.{il}.ffn_down.weight"] == "Q6_K"}
    assert q6 == {0, 3, 6, 7} and all(types[f"blk.{il}.attn_v.weight"] == ("Q6_K" if il in q6 else "Q4_K")
                                      for il in range(8))


def test_the_engine_runs_it_with_the_real_tokenizer(model):
    from pyllama_paged import Llama

    llm = Llama(model_path=model["path"], paged=True, n_ctx=256, n_threads=2, verbose=False)
    ids = llm.tokenize(b"The capital of France is")
    assert len(ids) == 6   # bos + 5 words, as the default model's tokenizer splits it
    seq = llm.runner.add_sequence(ids)
    logits = np.asarray(llm.runner.prefill(seq))
    assert logits.shape == (262144,) and np.isfinite(logits).all() and logits.std() > 0.5
    assert llm("Hello", max_tokens=4, temperature=0)["usage"]["completion_tokens"] == 4
