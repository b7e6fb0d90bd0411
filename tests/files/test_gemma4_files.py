"""gemma4 files: the tiny files read as llama.cpp reads Gemma 4 (per-layer head sizes, KV
heads, rope and FFN widths, shared-KV layers, per-layer embeddings, experts beside the dense
FFN), and a broken file is refused with a ModelLoadError naming the field, tensor or layer at
fault; so are per-layer shapes the native core is handed wrong."""
from pathlib import Path

import gguf
import pytest

from pyllama_paged._native import ffi, last_error, lib
from pyllama_paged.engine.worker.model import Model
from pyllama_paged.errors import ModelLoadError
from pyllama_paged.testing import gguf_mutate
from pyllama_paged.testing.reference.tiny_gemma4 import write_tiny_gemma4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-files")
    return {"dense": write_tiny_gemma4(root / "dense.gguf", "dense"),
            "moe": write_tiny_gemma4(root / "moe.gguf", "moe")}


def mutated(tmp_path, source, ops):
    out = tmp_path / "mutated.gguf"
    out.write_bytes(gguf_mutate.build(gguf_mutate.parse(Path(source).read_bytes()), ops))
    return str(out)


def test_the_dense_file_reads_as_llama_cpp_reads_gemma4(tiny):
    model = Model(tiny["dense"])
    try:
        c = model.config
        assert (c.arch, c.n_layer, c.head_dim, c.n_rot, c.attn_scale, c.embd_scale, c.final_logit_softcap) == \
               ("gemma4", 8, 128, 128, 1.0, 16.0, 30.0)
        assert c.layer_window == [8, 8, 0, 8, 8, 0, 8, 0]
        assert c.layer_head_dim == c.layer_n_rot == [64, 64, 128, 64, 64, 128, 64, 128]
        assert c.layer_n_ff == [512] * 6 + [1024] * 2 and c.layer_n_head_kv == [1] * 8
        # the last two layers read the last earlier sliding (4) and full (5) layers' KV
        assert c.layer_kv_source == [-1] * 6 + [4, 5] and [c.owns_kv(il) for il in range(8)] == [True] * 6 + [False] * 2
        assert (c.n_embd_per_layer, c.n_expert, c.rope_freq_base, c.rope_freq_base_swa) == (32, 0, 1e6, 1e4)
        assert [c.kv_values(il) for il in range(3)] == [64, 64, 128]
    finally:
        model.close()


def test_the_moe_file_has_per_layer_kv_heads_and_experts(tiny):
    model = Model(tiny["moe"])
    try:
        c = model.config
        assert c.layer_n_head_kv == [4, 1] and c.n_head_kv == 4 and c.layer_kv_source == [-1] * 2
        assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff, c.n_embd_per_layer) == (8, 2, 256, 256, 0)
        assert [c.kv_values(il) for il in range(2)] == [256, 128]
    finally:
        model.close()


@pytest.mark.parametrize("shape,drop", [("dense", "blk.3.attn_v.weight"), ("moe", "blk.1.layer_output_scale.weight"),
                                        ("moe", "blk.0.ffn_down_exps.scale")])
def test_what_a_file_may_leave_out(tmp_path, shape, drop):
    """A V projection (K stands in), the output scale and the experts' output scales are optional."""
    path = write_tiny_gemma4(tmp_path / "less.gguf", shape, drop=[drop])
    Model(path).close()


def test_separate_expert_gate_and_up_load(tmp_path):
    Model(write_tiny_gemma4(tmp_path / "apart.gguf", "moe", fused_experts=False)).close()


DENSE_CASES = [
    gguf_mutate.missing_tensor_case("rope_freqs.weight"),
    gguf_mutate.missing_tensor_case("blk.0.attn_k.weight"),
    gguf_mutate.missing_tensor_case("blk.5.attn_k_norm.weight"),
    gguf_mutate.missing_tensor_case("blk.7.attn_q_norm.weight"),
    gguf_mutate.missing_tensor_case("per_layer_token_embd.weight"),
    gguf_mutate.missing_tensor_case("blk.2.inp_gate.weight"),
    gguf_mutate.missing_tensor_case("blk.6.post_norm.weight"),
    ([["kv_drop", "gemma4.embedding_length_per_layer_input"]],
     r"missing metadata field 'gemma4\.embedding_length_per_layer_input'"),
    ([["kv", "gemma4.embedding_length_per_layer_input", gguf_mutate.U32, 64]],
     r"tensor 'per_layer_token_embd\.weight': shape \[256, 415\] but the hyper-parameters need \[512, 415\]"),
    ([["kv_drop", "gemma4.attention.sliding_window_pattern"]],
     r"missing metadata field 'gemma4\.attention\.sliding_window_pattern'"),
    ([["kv", "gemma4.attention.sliding_window_pattern", gguf_mutate.ARRAY,
       {"etype": gguf_mutate.BOOL, "items": [True, False, True]}]],
     r"'gemma4\.attention\.sliding_window_pattern' must be 8 booleans, got an array of 3"),
    # one layer of KV of its own, a sliding one: layer 2, full, has none of its kind to read
    ([["kv", "gemma4.attention.shared_kv_layers", gguf_mutate.U32, 7]],
     r"layer 2 shares KV \(gemma4\.attention\.shared_kv_layers = 7\), but no earlier layer of its kind "
     r"\(full attention\) has KV of its own"),
    ([["kv", "gemma4.attention.shared_kv_layers", gguf_mutate.U32, 8]],
     r"'gemma4\.attention\.shared_kv_layers' is 8, outside \[0, 7\]"),
    ([["kv", "gemma4.attention.key_length_swa", gguf_mutate.U32, 96],
      ["kv", "gemma4.attention.value_length_swa", gguf_mutate.U32, 96]],
     r"tensor 'blk\.0\.attn_q\.weight': shape \[256, 256\] but the hyper-parameters need \[256, 384\]"),
    ([["kv", "gemma4.attention.value_length_swa", gguf_mutate.U32, 32]],
     r"value_length_swa != key_length_swa is not supported"),
    ([["kv", "gemma4.rope.dimension_count_swa", gguf_mutate.U32, 80]],
     r"'gemma4\.rope\.dimension_count_swa' is 80; it must be even and at most key_length_swa 64"),
    ([["kv", "gemma4.feed_forward_length", gguf_mutate.ARRAY, {"etype": gguf_mutate.U32, "items": [512] * 7}]],
     r"'gemma4\.feed_forward_length' must be an integer or 8 integers >= 1, got an array of 7"),
    ([["kv", "gemma4.feed_forward_length", gguf_mutate.U32, 512]],
     r"tensor 'blk\.6\.ffn_gate\.weight': shape \[256, 1024\] but the hyper-parameters need \[256, 512\]"),
    ([["tensor", "blk.1.layer_output_scale.weight", "ttype", int(gguf.GGMLQuantizationType.F16)]],
     r"tensor 'blk\.1\.layer_output_scale\.weight': type f16, but norm weights and biases must be f32"),
]

MOE_CASES = [
    ([["tensor_drop", "blk.0.ffn_gate_up_exps.weight"]],
     r"layer 0: the experts' gate and up must be either 'blk\.0\.ffn_gate_up_exps\.weight' or both "
     r"'blk\.0\.ffn_gate_exps\.weight' and 'blk\.0\.ffn_up_exps\.weight'"),
    gguf_mutate.missing_tensor_case("blk.1.ffn_gate_inp.scale"),
    gguf_mutate.missing_tensor_case("blk.0.post_ffw_norm_2.weight"),
    gguf_mutate.missing_tensor_case("blk.1.pre_ffw_norm_2.weight"),
    gguf_mutate.missing_tensor_case("blk.0.ffn_up.weight"),
    ([["kv", "gemma4.expert_count", gguf_mutate.U32, 4]],
     r"tensor 'blk\.0\.ffn_gate_inp\.weight': shape \[256, 8\] but the hyper-parameters need \[256, 4\]"),
    ([["kv", "gemma4.attention.head_count_kv", gguf_mutate.ARRAY, {"etype": gguf_mutate.I32, "items": [4, 1, 1]}]],
     r"'gemma4\.attention\.head_count_kv' must be an integer or 2 integers >= 1, got an array of 3"),
    ([["kv", "gemma4.attention.head_count_kv", gguf_mutate.ARRAY, {"etype": gguf_mutate.I32, "items": [4, 3]}]],
     r"layer 1: head_count 8 is not a multiple of its head_count_kv 3"),
    ([["kv", "gemma4.attention.head_count_kv", gguf_mutate.ARRAY, {"etype": gguf_mutate.I32, "items": [4, 2]}]],
     r"tensor 'blk\.1\.attn_k\.weight': shape \[256, 128\] but the hyper-parameters need \[256, 256\]"),
]


@pytest.mark.parametrize("shape,ops,message", [("dense", *c) for c in DENSE_CASES] + [("moe", *c) for c in MOE_CASES])
def test_a_broken_gemma4_file_is_refused_precisely(tmp_path, tiny, shape, ops, message):
    with pytest.raises(ModelLoadError, match=message):
        Model(mutated(tmp_path, tiny[shape], ops))
    Model(tiny[shape]).close()   # and the next load still works


def _native_hparams(**fields):
    hp = {"arch": lib.PP_ARCH_GEMMA4, "n_layer": 3, "n_embd": 64, "n_head": 4, "n_head_kv": 1, "head_dim": 32,
          "n_ff": 64, "n_vocab": 300, "n_ctx_train": 64, "rope_type": 2, "rope_freq_base": 1e6, "rope_freq_scale": 1.0,
          "rope_freq_base_swa": 1e4, "rms_eps": 1e-6, "attn_scale": 1.0, "embd_scale": 8.0}
    keep = []
    for name, value in fields.items():
        if isinstance(value, list):
            keep.append(ffi.new("int32_t[]", value))
            value = keep[-1]
        hp[name] = value
    return ffi.new("pp_model_hparams *", hp), keep


@pytest.mark.parametrize("fields,message", [
    ({"layer_head_dim": [16, 64, 16]}, "layer 1: head size 64 must be even and at most key_length 32"),
    ({"layer_n_head_kv": [1, 3, 1]}, "layer 1: head_count 4 must be a multiple of its head_count_kv 3"),
    ({"layer_n_rot": [16, 34, 16]}, "layer 1: 34 rotated dims must be even and at most its head size 32"),
    ({"layer_n_ff": [64, 0, 64]}, "layer 1: feed_forward_length 0 must be positive"),
    ({"layer_kv_source": [-1, -1, 2]}, "layer 2: its KV source 2 is not an earlier layer with KV of its own"),
    ({"layer_kv_source": [-1, 0, 1]}, "layer 2: its KV source 1 is not an earlier layer with KV of its own"),
    ({"layer_kv_source": [-1, -1, 0], "layer_window": [8, 0, 0]}, "layer 2: its KV source 0 is not an earlier layer"),
    ({"layer_kv_source": [-1, -1, 0], "layer_head_dim": [16, 32, 32]}, "layer 2: its KV source 0 is not"),
    ({"n_embd_per_layer": -1}, "embedding_length_per_layer_input -1 must be >= 0"),
])
def test_the_native_core_checks_per_layer_shapes_itself(fields, message):
    """pp_model_create refuses what config_from_metadata never hands it."""
    hp, keep = _native_hparams(**fields)
    out = ffi.new("pp_model **")
    assert lib.pp_model_create(hp, out) == lib.PP_ERR_INVALID
    assert message in last_error()
    good, keep = _native_hparams(layer_kv_source=[-1, -1, 1], layer_head_dim=[16, 32, 32], layer_window=[8, 0, 0])
    assert lib.pp_model_create(good, out) == lib.PP_OK
    lib.pp_model_destroy(out[0])


def test_a_lora_adapter_is_refused_clearly(tmp_path, tiny):
    """gemma4's graph adds no adapter's products: an adapter is refused, not silently ignored."""
    from pyllama_paged.engine.worker.lora import LoraAdapter
    from pyllama_paged.testing.reference.tiny_lora import write_tiny_lora

    adapter = write_tiny_lora(tmp_path / "adapter.gguf", tiny["dense"], targets=("attn_q",))
    model = Model(tiny["dense"])
    try:
        with pytest.raises(ModelLoadError, match="LoRA adapters are not supported for gemma4 models yet"):
            LoraAdapter(model, adapter)
    finally:
        model.close()
