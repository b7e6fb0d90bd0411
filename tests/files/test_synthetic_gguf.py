"""pyllama_paged/testing/synthetic_gguf.py: the random-weight Gemma 3 GGUF that benchmarks use as a
realistically sized model. Checked small: its blocks decode to the intended values, the
Q4_K_M type mix is llama.cpp's, and the engine runs it with the real tokenizer."""

import gguf
import numpy as np
import pytest

from pyllama_paged.gguf.reader import GGUFFile
from pyllama_paged.testing import synthetic_gguf

SHAPE = dict(n_embd=256, n_layer=8, n_head=2, n_head_kv=1, n_ff=512)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic") / "small.gguf"
    return synthetic_gguf.write(path, **SHAPE, seed=3)


@pytest.fixture(scope="module")
def tensors(model):
    # our reader: gguf.GGUFReader takes seconds over the 262k-token vocabulary
    f = GGUFFile(model["path"])
    return {t.name: (t, f.tensor_bytes(t)) for t in f.tensors}


def test_blocks_decode_to_centred_values_of_the_intended_spread(model, tensors):
    for name, want_std in (("token_embd.weight", 0.5 / 16), ("blk.0.attn_q.weight", 1 / 16),
                           ("blk.0.ffn_down.weight", 1 / np.sqrt(512)), ("blk.3.ffn_down.weight", 1 / np.sqrt(512))):
        t, data = tensors[name]
        rows = data.reshape(t.shape[1], -1)[:4096]   # the embedding's first rows will do
        x = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(t.type))
        assert x.std() == pytest.approx(want_std, rel=0.1), name
        assert abs(x.mean()) < 0.1 * want_std, name
    assert sum(int(np.prod(t.shape)) for t, _ in tensors.values()) == model["n_params"]


def test_the_type_mix_is_q4_k_m(tensors):
    types = {name: gguf.GGMLQuantizationType(t.type).name for name, (t, _) in tensors.items()}
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


def test_the_command_line_takes_a_preset_and_the_old_shape_flags(tmp_path, capsys):
    from pyllama_paged.gguf.reader import read_metadata

    out = tmp_path / "llama.gguf"
    assert synthetic_gguf.main(["--preset", "llama3.2-1b", "--small", "--out", str(out)]) == 0
    meta = read_metadata(str(out))
    assert (meta["general.architecture"], meta["llama.block_count"], meta["tokenizer.ggml.pre"]) == \
           ("llama", 2, "llama-bpe")
    out = tmp_path / "gemma.gguf"
    assert synthetic_gguf.main(["--out", str(out), "--n-embd", "256", "--n-layer", "3", "--n-head", "2",
                                "--n-head-kv", "1", "--n-ff", "512"]) == 0
    meta = read_metadata(str(out))
    assert (meta["general.architecture"], meta["gemma3.block_count"], meta["gemma3.embedding_length"]) == \
           ("gemma3", 3, 256)
    assert "gemma3-1.6b, 0.07B parameters" in capsys.readouterr().out


def test_mmproj_writes_a_projector_of_the_models_width(tmp_path):
    from pyllama_paged.vision.projector import Projector

    mmproj = tmp_path / "mmproj.gguf"
    assert synthetic_gguf.main(["--small", "--out", str(tmp_path / "gemma.gguf"), "--n-embd", "256",
                                "--n-ff", "512", "--mmproj", str(mmproj)]) == 0
    with Projector(str(mmproj)) as projector:
        assert (projector.projector_type, projector.projection_dim, projector.n_tokens) == ("gemma3", 256, 16)
    with pytest.raises(SystemExit):   # only gemma3 presets have a projector writer
        synthetic_gguf.main(["--preset", "llama3.2-1b", "--small", "--out", str(tmp_path / "l.gguf"),
                             "--mmproj", str(tmp_path / "l-mm.gguf")])


def test_llama3_rope_divisors_leave_short_wavelengths_and_stretch_long_ones():
    divisors = synthetic_gguf.llama3_rope_divisors(64, 500000.0)
    assert len(divisors) == 32 and divisors[0] == 1.0 and divisors[-1] == 32.0
    assert np.all(np.diff(divisors) >= 0) and ((divisors > 1) & (divisors < 32)).sum() == 3   # the blend
