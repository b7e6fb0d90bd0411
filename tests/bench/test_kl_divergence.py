"""bench/engine/kl_divergence.py: the KL measure on distributions whose divergence is known by
hand, llama-perplexity's base-file format written and read back (its layout checked byte by byte),
and our engine's scored rows lined up with the float64 reference's on a tiny model."""

import math
import struct

import numpy as np
import pytest



@pytest.fixture(scope="module")
def kld(bench):
    return bench("bench.engine.kl_divergence")


def logits_of(probs):
    """Logits (shifted by an arbitrary constant, which softmax ignores) of a distribution."""
    return np.log(np.asarray(probs, dtype=np.float64)) + 3.0


# KL((0.5, 0.5) || (0.9, 0.1)) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1), and the other way round
HALVES_FROM_NINE_TENTHS = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
NINE_TENTHS_FROM_HALVES = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)


def test_exact_kl_is_zero_for_equal_distributions_and_the_hand_value_otherwise(kld):
    p = [[0.5, 0.5], [0.9, 0.1]]
    ref = kld.log_softmax(logits_of(p))
    assert np.allclose(kld.kl_exact(ref, logits_of(p)), 0.0, atol=1e-15)
    got = kld.kl_exact(ref, logits_of([[0.9, 0.1], [0.5, 0.5]]))
    assert got == pytest.approx([HALVES_FROM_NINE_TENTHS, NINE_TENTHS_FROM_HALVES], rel=1e-12)
    assert HALVES_FROM_NINE_TENTHS == pytest.approx(0.5108256, abs=1e-7)   # the order matters


def test_base_rows_keep_16_nats_below_the_best_token_to_16_bits(kld):
    ref = kld.log_softmax(np.array([[0.0, -1.0, -2.5, -15.0, -30.0, 2.0, 1.0]]))
    rows = kld.quantize_log_probs(ref)
    assert rows.shape == (1, kld.row_width(7)) == (1, 12) and rows.dtype == np.uint16
    back = kld.dequantize_rows(rows, 7)[0]
    scale = float(rows[0, :4].copy().view(np.float32)[0])
    assert scale == pytest.approx(16.0 / 65535, rel=1e-6)
    best = int(np.argmax(ref[0]))
    assert rows[0, 4 + best] == 65535 and back[best] == pytest.approx(ref[0, best], abs=1e-6)
    near = ref[0] > ref[0, best] - 16
    assert np.abs(back[near] - ref[0, near]).max() <= scale / 2 + 1e-6
    # more than 16 nats below the best: level 0, the floor llama-perplexity leaves out
    assert rows[0, 4 + 4] == 0 and back[4] <= kld.KL_FLOOR


def test_the_base_format_kl_matches_the_hand_values_and_leaves_out_the_tail(kld):
    p, q = logits_of([[0.5, 0.5], [0.9, 0.1]]), logits_of([[0.9, 0.1], [0.9, 0.1]])
    rows = kld.quantize_log_probs(kld.log_softmax(p))
    scores = kld.kl_base_format(rows, q, 2, next_tokens=[0, 1])
    assert scores.kl == pytest.approx([HALVES_FROM_NINE_TENTHS, 0.0], abs=1e-4)
    assert scores.same_top.tolist() == [True, True]   # a tie's first token is the best, as in llama.cpp
    assert scores.nll == pytest.approx([-math.log(0.9), -math.log(0.1)], rel=1e-9)
    # a reference token at e^-20 (below the floor) counts fully in the exact KL, not in the format's
    ref = kld.log_softmax(np.array([[0.0, -0.5, -20.0]]))
    engine = np.array([[0.0, -0.5, -3.0]])
    tail = math.exp(ref[0, 2]) * (ref[0, 2] - kld.log_softmax(engine)[0, 2])
    exact = kld.kl_exact(ref, engine)[0]
    base = kld.kl_base_format(kld.quantize_log_probs(ref), engine, 3, [1]).kl[0]
    assert base == pytest.approx(exact - tail, abs=1e-4) and tail < 0


def test_the_base_file_round_trips_in_llama_perplexitys_layout(kld, tmp_path):
    ctx, n_vocab, rng = 8, 5, np.random.default_rng(1)
    chunks = rng.integers(0, n_vocab, size=(2, ctx)).astype(np.int32)
    n_rows = len(kld.scored_positions(ctx))
    assert list(kld.scored_positions(ctx)) == [4, 5, 6] == list(range(ctx // 2, ctx - 1))
    rows = kld.quantize_log_probs(kld.log_softmax(rng.normal(size=(2 * n_rows, n_vocab)) * 4))
    path = tmp_path / "base.kld"
    with open(path, "wb") as f:
        kld.write_base_header(f, ctx, n_vocab, chunks)
        f.write(rows.tobytes())
    raw = path.read_bytes()
    width = 2 * ((n_vocab + 1) // 2) + 4
    assert len(raw) == 8 + 12 + 4 * chunks.size + 2 * len(rows) * width
    assert raw[:8] == b"_logits_" and struct.unpack("<iii", raw[8:20]) == (ctx, n_vocab, 2)
    assert struct.unpack(f"<{chunks.size}i", raw[20:20 + 4 * chunks.size]) == tuple(chunks.reshape(-1))
    first_row = raw[20 + 4 * chunks.size:][:2 * width]
    scale, low = struct.unpack("<ff", first_row[:8])
    assert (scale, low) == tuple(rows[0, :4].copy().view(np.float32))
    back = kld.read_base_file(path)
    assert (back.ctx, back.n_vocab) == (ctx, n_vocab)
    assert np.array_equal(back.chunks, chunks)
    assert np.array_equal(np.asarray(back.rows).reshape(-1, width), rows)


@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_our_scored_rows_line_up_with_the_references_on_a_tiny_model(kld, tmp_path, monkeypatch, arch):
    """gemma4 through its own reference module (loader.py), which keys the cache too."""
    from pyllama_paged.engine import EngineConfig, Model
    from pyllama_paged.engine.worker.model_runner import ModelRunner
    from pyllama_paged.testing.reference.tiny_gemma4 import write_tiny_gemma4
    from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    monkeypatch.setattr(kld, "CACHE_DIR", tmp_path / "cache")
    if arch == "gemma4":
        path = write_tiny_gemma4(tmp_path / "tiny.gguf", "dense")
        assert kld.reference_sources(path)[-1].endswith("gemma4_reference.py")
    else:
        path = write_tiny_model(tmp_path / "tiny.gguf", "gemma3", context_length=64)
    text = ("The licenses for most software are designed to take away your freedom to share and "
            "change it. By contrast, this license is intended to guarantee your freedom. ") * 3
    chunks = kld.text_chunks(Tokenizer.from_gguf(path), text, 64, 2)
    assert chunks.shape == (2, 64) and (chunks[:, 0] == 2).all()   # gemma3's BOS, then the text
    states, _ = kld.reference_states(path, chunks)
    assert states.shape == (2, 31, 256)
    assert np.array_equal(kld.reference_states(path, chunks)[0], states)   # the cached copy
    head = kld.ReferenceHead.from_gguf(path)
    model = Model(path)
    # steps of 20 tokens: the scored rows start inside a step, and the last step is short
    runner = ModelRunner(model, EngineConfig(paged=True, n_ctx=64, n_threads=2, n_batch=20, block_size=16))
    try:
        for chunk, chunk_states in zip(chunks, states):
            ref = head.log_probs(chunk_states)
            ours = kld.our_scored_logits(runner, chunk, 20)
            scores = kld.kl_exact_scores(ref, ours, chunk[33:64])
            # rows off by one position would differ by a whole distribution (KL ~1 for this model)
            assert scores.kl.max() < 1e-2 and scores.same_top.mean() > 0.8
            shifted = kld.kl_exact(ref[1:], ours[:-1])
            assert shifted.mean() > 100 * scores.kl.mean()
            base = kld.kl_base_format(kld.quantize_log_probs(ref), ours, len(ref[0]), chunk[33:64])
            assert np.abs(base.kl - scores.kl).max() < 1e-4
    finally:
        runner.close()
        model.close()
