"""bench/common/roofline.py's account of what a step reads and multiplies: a dense model's step
reads its whole file; a mixture-of-experts step reads the dense weights and the experts its tokens
picked, and a token multiplies through n_used experts only (active parameters)."""

from pathlib import Path

import gguf
import pytest

from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model


@pytest.fixture(scope="module")
def roofline(bench):
    return bench("bench.common.roofline")

SHAPE = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=1, head_dim=16)
N_EXPERT, N_FF_EXP = 8, 32


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("roofline")
    moe = {used: write_tiny_model(root / f"moe{used}.gguf", "qwen3moe", weight_type="f16", strict=True, **SHAPE,
                                  n_expert=N_EXPERT, n_expert_used=used, n_ff_exp=N_FF_EXP) for used in (2, 4)}
    dense = write_tiny_model(root / "dense.gguf", "qwen3", weight_type="f16", strict=True, **SHAPE)
    return {"dense": Path(dense), **{f"moe{u}": Path(p) for u, p in moe.items()}}


def lookup_bytes(path: Path) -> int:
    """An untied input embedding's bytes (a step reads only its tokens' rows), else 0."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    return int(tensors["token_embd.weight"].n_bytes) if "output.weight" in tensors else 0


def test_a_dense_step_reads_the_whole_file_at_any_batch(files, roofline):
    """...but an untied input embedding, of which it reads its tokens' rows."""
    w = roofline.model_weights(str(files["dense"]))
    assert (w.expert_bytes, w.n_expert) == (0, 0)
    size = files["dense"].stat().st_size - lookup_bytes(files["dense"])
    assert [w.step_bytes(n) for n in (1, 16, 512)] == [size] * 3


def test_a_tied_embedding_is_the_head_and_read_every_step(tmp_path, roofline):
    path = Path(write_tiny_model(tmp_path / "tied.gguf", "gemma3", weight_type="f16", strict=True))
    assert lookup_bytes(path) == 0
    assert roofline.model_weights(str(path)).step_bytes(1) == path.stat().st_size


def test_an_expert_step_reads_the_experts_its_tokens_picked(files, roofline):
    w = roofline.model_weights(str(files["moe2"]))
    # gate, up and down of every expert in every layer, f16
    experts = SHAPE["n_layer"] * 3 * N_EXPERT * N_FF_EXP * SHAPE["n_embd"] * 2
    assert w.expert_bytes == experts
    assert w.dense_bytes + w.expert_bytes + lookup_bytes(files["moe2"]) == files["moe2"].stat().st_size
    # one token touches n_used / n_expert of the experts; more tokens touch more, never past all
    assert w.step_bytes(1) == pytest.approx(w.dense_bytes + experts * 2 / N_EXPERT)
    reads = [w.step_bytes(n) for n in (1, 2, 4, 16, 64, 4096)]
    assert reads == sorted(reads) and len(set(reads)) == len(reads)
    assert reads[-1] == pytest.approx(w.dense_bytes + experts)


def test_a_token_multiplies_through_its_n_used_experts_only(files, roofline):
    two, four = roofline.model_weights(str(files["moe2"])), roofline.model_weights(str(files["moe4"]))
    per_expert = SHAPE["n_layer"] * 3 * N_FF_EXP * SHAPE["n_embd"]
    assert four.body_macs - two.body_macs == 2 * per_expert
    assert two.head_macs == four.head_macs > 0


def test_the_batched_ceiling_counts_active_bytes(files, roofline):
    """Memory-bound (an int8 peak too high to bind): one sequence's decode reads fewer bytes a
    step than the whole file, so the MoE ceiling is above the whole-file one."""
    w = roofline.model_weights(str(files["moe2"]))
    bandwidth, peak = 1e9, 1e18
    ceiling = roofline.batched_ceiling(w, 1, 1, 64, 512, bandwidth, peak)
    whole = 65 / (65 * (w.dense_bytes + w.expert_bytes) / bandwidth)
    assert ceiling > whole * 1.2
