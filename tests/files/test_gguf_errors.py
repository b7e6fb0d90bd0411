"""Bad model files raise ModelLoadError naming the file and the field or
tensor at fault; nothing crashes and the next load still works."""

import struct

import pytest

from pyllama_paged.engine import Model
from pyllama_paged.gguf.config import ModelLoadError
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.vocab_metadata import add_fields, finish


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gguf") / "llama.gguf", "llama", weight_type="q8_0")


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        Model(str(tmp_path / "nope.gguf"))


def test_not_gguf(tmp_path):
    p = tmp_path / "text.gguf"
    p.write_bytes(b"this is not a model at all, just text" * 4)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        Model(str(p))


@pytest.mark.parametrize("keep", [0.001, 0.05, 0.5, 0.999])
def test_truncated_file_names_what_is_cut(good_file, tmp_path, keep):
    data = open(good_file, "rb").read()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:max(24, int(len(data) * keep))])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        Model(str(p))
    assert str(p) in str(e.value)


def test_bad_version(good_file, tmp_path):
    data = bytearray(open(good_file, "rb").read())
    data[4:8] = struct.pack("<I", 99)
    p = tmp_path / "v99.gguf"
    p.write_bytes(data)
    with pytest.raises(ModelLoadError, match="version 99"):
        Model(str(p))


def test_unsupported_architecture(tmp_path):
    import gguf
    p = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(p), "mamba")
    w.add_block_count(1)
    finish(w)
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        Model(str(p))


def _bare_llama(path, *tensors, feed_forward: bool = True) -> str:
    """A one-layer llama GGUF with two tokens and only the tensors (name, shape) given."""
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(2)
    if feed_forward:
        w.add_feed_forward_length(128)
    w.add_token_list(["a", "b"])
    for name, shape in tensors:
        w.add_tensor(name, np.zeros(shape, np.float32))
    finish(w)
    return str(path)


def test_missing_field_and_tensor(good_file, tmp_path):
    with pytest.raises(ModelLoadError, match="llama.feed_forward_length"):
        Model(_bare_llama(tmp_path / "bare.gguf", feed_forward=False))
    with pytest.raises(ModelLoadError, match="missing tensor 'output_norm.weight'"):
        Model(_bare_llama(tmp_path / "notensors.gguf", ("token_embd.weight", (2, 64))))


def test_wrong_tensor_shape_names_the_tensor(tmp_path):
    p = _bare_llama(tmp_path / "shape.gguf", ("token_embd.weight", (2, 64)),
                    ("blk.0.attn_q.weight", (32, 64)))   # needs 64 x 64
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.attn_q.weight': shape \[64, 32\]"):
        Model(str(p))


def test_good_file_still_loads_after_failures(good_file):
    m = Model(good_file)
    assert m.config.arch == "llama"
    m.close()


def test_huge_counts_are_refused_before_anything_is_allocated(good_file, tmp_path):
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    data = open(good_file, "rb").read()
    for offset, pattern in ((8, r"tensor count is \d+, but only \d+ bytes follow"),
                            (16, r"metadata field count is \d+, but only \d+ bytes follow")):
        p = tmp_path / f"count{offset}.gguf"
        p.write_bytes(data[:offset] + struct.pack("<Q", 2**62) + data[offset + 8:])
        with pytest.raises(ModelLoadError, match=pattern):
            Model(str(p))
    # The tokenizer's own reader is the same bounds-checked parser.
    with pytest.raises(ModelLoadError, match="metadata field count"):
        Tokenizer.from_gguf(str(p))


def test_tokenizer_reader_errors_are_model_load_errors_and_value_errors(tmp_path):
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    p = tmp_path / "text.gguf"
    p.write_bytes(b"not a model" * 8)
    with pytest.raises(ModelLoadError, match="not a GGUF file") as e:
        Tokenizer.from_gguf(str(p))
    assert isinstance(e.value, ValueError)  # what this reader raised before


def test_mistyped_and_out_of_range_hyperparameters(tmp_path):
    import gguf

    def write(name, **fields):
        p = tmp_path / name
        w = gguf.GGUFWriter(str(p), "llama")
        w.add_token_list(["a", "b"])
        add_fields(w, {"llama.block_count": 1, "llama.embedding_length": 64, "llama.attention.head_count": 2,
                       "llama.feed_forward_length": 128, **fields}, integer="add_uint64")
        finish(w)
        return str(p)

    with pytest.raises(ModelLoadError, match=r"'llama.block_count' must be an integer, got the string '2'"):
        Model(write("s.gguf", **{"llama.block_count": "2"}))
    # Before the check this built a 2**40-entry list (MemoryError).
    with pytest.raises(ModelLoadError, match=r"'llama.block_count' is 1099511627776, outside \[1, 512\]"):
        Model(write("l.gguf", **{"llama.block_count": 2**40}))
    # Fits neither the native int32 field nor a sane context.
    with pytest.raises(ModelLoadError, match=r"'llama.context_length' is 4294967296, outside"):
        Model(write("c.gguf", **{"llama.context_length": 2**32}))


# Qwen3.5/3.6 hybrids: the ssm.* keys, the layer kinds and IMRoPE's sections are checked
# before anything native is made; tensors against the layer kind each layer has.
HYBRID_FIELD_ERRORS = [
    ({"qwen35.ssm.conv_kernel": None}, r"missing metadata field 'qwen35.ssm.conv_kernel'"),
    ({"qwen35.ssm.conv_kernel": 1}, r"'qwen35.ssm.conv_kernel' is 1, outside \[2, 64\]"),
    ({"qwen35.ssm.inner_size": 100}, r"'qwen35.ssm.inner_size' is 100, but ssm.state_size 64 x "),
    ({"qwen35.ssm.group_count": 3}, r"'qwen35.ssm.time_step_rank' is 4: the value heads must be a multiple"),
    ({"qwen35.attention.recurrent_layers": [True] * 4}, r"needs recurrent and full-attention layers; 4 of its 4"),
    ({"qwen35.attention.recurrent_layers": [True, False]}, r"'qwen35.attention.recurrent_layers' must be 4 booleans"),
    ({"qwen35.full_attention_interval": 0}, r"'qwen35.full_attention_interval' is 0, outside"),
    ({"qwen35.rope.dimension_sections": None}, r"missing metadata field 'qwen35.rope.dimension_sections'"),
    ({"qwen35.rope.dimension_sections": [0, 0, 0, 5]}, r"the first three not all 0"),
    ({"qwen35.rope.dimension_sections": [40, 40, 0, 0]}, r"sum at most key_length 64"),
    ({"qwen35.nextn_predict_layers": 4}, r"'qwen35.nextn_predict_layers' is 4, outside \[0, 3\]"),
    # the file's tensors no longer fit: layer 1 is full attention, and the linear heads' size
    ({"qwen35.full_attention_interval": 2}, r"missing tensor 'blk.1.attn_q.weight'"),
    ({"qwen35.ssm.state_size": 32, "qwen35.ssm.inner_size": 128},
     r"tensor 'blk.0.attn_qkv.weight': shape \[256, 512\] but the hyper-parameters need \[256, 256\]"),
]


@pytest.mark.parametrize("fields,message", HYBRID_FIELD_ERRORS)
def test_malformed_hybrid_metadata_names_the_field(tmp_path, fields, message):
    from pyllama_paged.testing.reference.tiny_qwen35 import write_tiny_qwen35

    path = write_tiny_qwen35(tmp_path / "hybrid.gguf", extra_metadata=fields)
    with pytest.raises(ModelLoadError, match=message) as e:
        Model(path)
    assert str(path) in str(e.value)


def test_malformed_hybrid_tensors_name_the_tensor(tmp_path):
    from pyllama_paged.testing.reference.tiny_qwen35 import write_tiny_qwen35

    # ggml_ssm_conv reads its kernel as f32, as llama.cpp's converter always writes it
    path = write_tiny_qwen35(tmp_path / "conv.gguf", type_overrides={"blk.*.ssm_conv1d.weight": "f16"})
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.ssm_conv1d.weight': type f16, but it must be f32"):
        Model(path)
    # qwen35moe's shared expert has a width of its own, which its file must give
    path = write_tiny_qwen35(tmp_path / "moe.gguf", "qwen35moe",
                             extra_metadata={"qwen35moe.expert_shared_feed_forward_length": None})
    with pytest.raises(ModelLoadError, match=r"missing metadata field 'qwen35moe.expert_shared_feed_forward_length'"):
        Model(path)


def test_hybrid_files_load_with_their_mtp_block_ignored(tmp_path):
    """The trunk's layers load (the multi-token-prediction block after them is not the model's),
    Q4_0 projections of the linear layers go to GGML's repacked layout like any other, and a
    hybrid refuses to be offloaded rather than run its state on the wrong side."""
    from pyllama_paged.testing.reference.tiny_qwen35 import write_tiny_qwen35

    for arch in ("qwen35", "qwen35moe"):
        path = write_tiny_qwen35(tmp_path / f"{arch}.gguf", arch, nextn_layers=1, weight_type="q4_0")
        m = Model(path, pack_panels=False)
        try:
            assert m.config.n_layer == 4 and m.config.layer_recurrent == [True, True, True, False]
            assert m.config.n_attention_layers == 1 and m.config.rope_sections == (3, 3, 2, 0)
            if _has_avx2():
                assert m.n_repacked > 0
        finally:
            m.close()


def _has_avx2() -> bool:
    from pyllama_paged._native import ffi, lib
    return "avx2=1" in ffi.string(lib.pp_ggml_build_info()).decode()
