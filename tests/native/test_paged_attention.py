"""The paged attention kernel against a plain softmax(QK^T)V over K/V gathered
through the block table, and against GGML's own flash attention."""

import ctypes

import numpy as np
import pytest

from pyllama_paged._native import ffi, lib
from pyllama_paged.testing.attention_harness import AttentionHarness


def gathered_attention(q, k_rows, v_rows, positions, n_head_kv, window, scale, sinks=None):
    """Reference: q [T, H, D]; k_rows/v_rows [L, n_head_kv*D] in logical order; sinks [H]:
    one more logit per head in the softmax's denominator, whose value is 0 (gpt-oss)."""
    T, H, D = q.shape
    group = H // n_head_kv
    k = k_rows.reshape(len(k_rows), n_head_kv, D).astype(np.float64)
    v = v_rows.reshape(len(v_rows), n_head_kv, D).astype(np.float64)
    out = np.zeros((T, H, D))
    for t, pos in enumerate(positions):
        lo = max(0, pos - window + 1) if window else 0
        for h in range(H):
            kv = h // group
            s = k[lo:pos + 1, kv] @ q[t, h].astype(np.float64) * scale
            top = s.max() if sinks is None else max(s.max(), sinks[h])
            p = np.exp(s - top)
            total = p.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            out[t, h] = (p / total) @ v[lo:pos + 1, kv]
    return out


def scatter_sequence(rng, harness, n_tokens, block_size, num_blocks, n_embd_kv, used):
    """Random K/V for one sequence written into randomly chosen free blocks."""
    n_blocks = -(-n_tokens // block_size)
    free = [b for b in rng.permutation(num_blocks) if b not in used][:n_blocks]
    used.update(free)
    k = rng.standard_normal((n_tokens, n_embd_kv)).astype(np.float32)
    v = rng.standard_normal((n_tokens, n_embd_kv)).astype(np.float32)
    slots = [free[i // block_size] * block_size + i % block_size for i in range(n_tokens)]
    harness.write(slots, k, v)
    kq, vq = harness.read(slots)   # what the kernel reads (after KV quantization)
    return np.array(free, np.int32), kq, vq


CASES = [
    # kv type, block size, head_dim, n_head, n_head_kv, lengths, window
    ("f16", 16, 64, 4, 4, [1, 16, 37], 0),
    ("f16", 32, 128, 8, 2, [100, 64], 0),
    ("f16", 7, 256, 4, 1, [50], 0),
    ("f16", 64, 64, 16, 1, [200], 48),
    ("q8_0", 32, 128, 4, 2, [70, 33], 0),
    ("q8_0", 128, 64, 6, 3, [300], 100),
    ("q4_0", 32, 64, 2, 1, [45], 0),
]


@pytest.mark.parametrize("kv_type,block_size,head_dim,n_head,n_head_kv,lengths,window", CASES)
def test_paged_kernel_matches_gathered_softmax(kv_type, block_size, head_dim, n_head, n_head_kv,
                                               lengths, window):
    rng = np.random.default_rng(hash((kv_type, block_size, head_dim)) % 2**32)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 5
    n_embd_kv = n_head_kv * head_dim
    h = AttentionHarness(kv_type, num_blocks * block_size, n_head, n_head_kv, head_dim, n_threads=2)
    used: set = set()
    max_blocks = max(-(-n // block_size) for n in lengths)
    tables = np.full((len(lengths), max_blocks), -1, np.int32)
    seqs = []
    for s, n in enumerate(lengths):
        blocks, k, v = scatter_sequence(rng, h, n, block_size, num_blocks, n_embd_kv, used)
        tables[s, :len(blocks)] = blocks
        seqs.append((k, v))
    # query every sequence at its last position plus a prefill chunk of the first
    positions, seq_index = [], []
    first = lengths[0]
    chunk = list(range(max(0, first - 9), first))
    positions += chunk
    seq_index += [0] * len(chunk)
    for s, n in enumerate(lengths[1:], start=1):
        positions.append(n - 1)
        seq_index.append(s)
    q = rng.standard_normal((len(positions), n_head, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    got = h.paged(q, positions, seq_index, tables, block_size, window, scale)
    want = np.zeros_like(got, dtype=np.float64)
    for t, (pos, s) in enumerate(zip(positions, seq_index)):
        k, v = seqs[s]
        want[t:t + 1] = gathered_attention(q[t:t + 1], k, v, [pos], n_head_kv, window, scale)
    # Only the query's conversion to the cache's dot type separates the two.
    tol = {"f16": 2e-3, "q8_0": 2e-2, "q4_0": 5e-2}[kv_type]
    assert np.abs(got - want).max() < tol
    h.close()


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("head_dim,n_head,n_head_kv,window", [
    (64, 8, 2, 0),     # SIMD paths, group 4: tiles of several tokens
    (64, 8, 2, 40),    # a window shorter than the prompt: tiles straddle its edge
    (96, 3, 1, 0),     # group 3: an odd number of rows per tile; 96 % 32 != 0
    (32, 2, 2, 25),    # MHA: up to 32 tokens per tile
])
def test_whole_prompt_prefill_matches_gathered_softmax(kv_type, head_dim, n_head, n_head_kv, window):
    """Every position of a 150-token prompt queried in one batch (query tiles)."""
    rng = np.random.default_rng(head_dim * 1000 + n_head + window)
    block_size, n = 16, 150
    num_blocks = -(-n // block_size) + 3
    h = AttentionHarness(kv_type, num_blocks * block_size, n_head, n_head_kv, head_dim, n_threads=2)
    blocks, k, v = scatter_sequence(rng, h, n, block_size, num_blocks, n_head_kv * head_dim, set())
    tables = blocks.reshape(1, -1)
    positions = list(range(n))
    q = rng.standard_normal((n, n_head, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    got = h.paged(q, positions, [0] * n, tables, block_size, window, scale)
    want = gathered_attention(q, k, v, positions, n_head_kv, window, scale)
    # q8_0 keys are dotted in int8 against the query quantized to q8_0, as
    # GGML's own attention does; that rounding is the whole error.
    assert np.abs(got - want).max() < {"f16": 2e-3, "q8_0": 3e-2}[kv_type]
    h.close()


def test_head_size_without_simd_lanes_matches_gathered_softmax():
    """A head size that is not a multiple of 8 takes the scalar paths."""
    rng = np.random.default_rng(7)
    head_dim, n_head, n_head_kv, block_size, n = 6, 4, 2, 8, 40
    h = AttentionHarness("f16", 8 * block_size, n_head, n_head_kv, head_dim, n_threads=2)
    blocks, k, v = scatter_sequence(rng, h, n, block_size, 8, n_head_kv * head_dim, set())
    q = rng.standard_normal((n, n_head, head_dim)).astype(np.float32)
    got = h.paged(q, list(range(n)), [0] * n, blocks.reshape(1, -1), block_size, 0, 0.4)
    want = gathered_attention(q, k, v, list(range(n)), n_head_kv, 0, 0.4)
    assert np.abs(got - want).max() < 2e-3
    h.close()


def test_shared_blocks_serve_two_sequences():
    """Two sequences whose tables point at the same prefix blocks (as after a fork)."""
    rng = np.random.default_rng(7)
    bs, D = 16, 64
    h = AttentionHarness("f16", 8 * bs, 2, 1, D)
    k = rng.standard_normal((8 * bs, D)).astype(np.float32)
    v = rng.standard_normal((8 * bs, D)).astype(np.float32)
    h.write(range(8 * bs), k, v)
    kq, vq = h.read(range(8 * bs))
    tables = np.array([[0, 1, 2], [0, 1, 5]], np.int32)   # shared blocks 0, 1; own last block
    q = rng.standard_normal((2, 2, D)).astype(np.float32)
    got = h.paged(q, [40, 40], [0, 1], tables, bs)
    for s, table in enumerate(tables):
        rows = np.concatenate([np.arange(b * bs, b * bs + bs) for b in table])[:41]
        want = gathered_attention(q[s:s + 1], kq[rows], vq[rows], [40], 1, 0, D ** -0.5)
        assert np.abs(got[s] - want[0]).max() < 2e-3
    assert np.abs(got[0] - got[1]).max() > 1e-3  # the different last block matters


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_paged_matches_ggml_flash_attention(kv_type):
    rng = np.random.default_rng(3)
    bs, D, n = 32, 128, 150
    h = AttentionHarness(kv_type, 8 * bs, 4, 2, D, n_threads=2)
    h.write(range(n), rng.standard_normal((n, 2 * D)), rng.standard_normal((n, 2 * D)))
    positions = [n - 5, n - 4, n - 3, n - 2, n - 1]
    q = rng.standard_normal((5, 4, D)).astype(np.float32)
    table = np.arange(8, dtype=np.int32)[None, :]
    paged = h.paged(q, positions, [0] * 5, table, bs, window=64)
    contiguous = h.contiguous(q, 0, n, positions, window=64)
    assert np.abs(paged - contiguous).max() < 2e-2


@pytest.mark.parametrize("n_threads,length,window", [(2, 1500, 0), (4, 3000, 0), (3, 2000, 700)])
def test_split_k_decode_matches_gathered_softmax(n_threads, length, window):
    """One long sequence, one query: the key range is split across threads
    and merged by log-sum-exp."""
    rng = np.random.default_rng(length)
    bs, D = 32, 128
    num_blocks = -(-length // bs) + 3
    h = AttentionHarness("f16", num_blocks * bs, 4, 1, D, n_threads=n_threads)
    blocks, k, v = scatter_sequence(rng, h, length, bs, num_blocks, D, set())
    q = rng.standard_normal((1, 4, D)).astype(np.float32)
    got = h.paged(q, [length - 1], [0], blocks[None, :], bs, window)
    want = gathered_attention(q, k, v, [length - 1], 1, window, D ** -0.5)
    assert np.abs(got - want).max() < 2e-3


@pytest.mark.parametrize("n_threads,length,window", [(2, 40, 0), (2, 90, 32), (4, 3000, 0)])
def test_attention_sinks_join_the_softmax_in_both_operators(n_threads, length, window):
    """gpt-oss's sinks: our kernel (one pass, and split-K at 3000 keys on 4 threads, where
    the sink must count once) and GGML's flash attention against the reference; and a
    sink the size of the scores changes the output (a kernel that ignored it fails)."""
    rng = np.random.default_rng(length)
    bs, D, H = 16, 64, 4
    num_blocks = -(-length // bs) + 2
    h = AttentionHarness("f16", num_blocks * bs, H, 2, D, n_threads=n_threads)
    blocks, k, v = scatter_sequence(rng, h, length, bs, num_blocks, 2 * D, set())
    # comparable to the sum of a few thousand keys' weights, so each sink moves the output
    sinks = np.array([2.0, -1.0, 0.5, 4.0], np.float32) + np.float32(np.log(length))
    positions = list(range(length - 3, length))
    q = rng.standard_normal((3, H, D)).astype(np.float32)
    want = gathered_attention(q, k, v, positions, 2, window, D ** -0.5, sinks)
    plain = gathered_attention(q, k, v, positions, 2, window, D ** -0.5)
    assert np.abs(want - plain).max() > 0.05
    h.set_sinks(sinks)
    got = h.paged(q, positions, [0] * 3, blocks[None, :], bs, window)
    assert np.abs(got - want).max() < 2e-3
    if length == 3000:   # one query at a time: the split-K path (few items, long keys)
        one = h.paged(q[-1:], positions[-1:], [0], blocks[None, :], bs, window)
        assert np.abs(one - want[-1:]).max() < 2e-3
    else:                # GGML's flash attention over the same rows laid out contiguously
        h2 = AttentionHarness("f16", length, H, 2, D, n_threads=n_threads)
        h2.write(range(length), k, v)
        h2.set_sinks(sinks)
        assert np.abs(h2.contiguous(q, 0, length, positions, window) - want).max() < 2e-2
    h.set_sinks(None)
    assert np.abs(h.paged(q, positions, [0] * 3, blocks[None, :], bs, window) - plain).max() < 2e-3


def test_harness_refuses_batches_the_kernel_cannot_take():
    """Empty batches and positions that go backwards within a sequence are errors, not crashes."""
    from pyllama_paged.errors import NativeError
    h = AttentionHarness("f16", 4 * 16, 2, 1, 64, n_threads=2)
    tables = np.array([[0, 1]], np.int32)
    with pytest.raises(NativeError, match="empty batch"):
        h.paged(np.zeros((0, 2, 64), np.float32), [], [], tables, 16, 0, 0.125)
    with pytest.raises(NativeError, match="must increase"):
        h.paged(np.zeros((2, 2, 64), np.float32), [5, 3], [0, 0], tables, 16, 0, 0.125)
    h.close()


def test_a_nan_key_poisons_its_queries_as_in_plain_softmax():
    """A NaN score is not silently dropped by the vector exp (it was clamped to ~0 there)."""
    rng = np.random.default_rng(11)
    head_dim, block_size, n = 64, 16, 16
    h = AttentionHarness("f16", 2 * block_size, 2, 1, head_dim, n_threads=1)
    k = rng.standard_normal((n, head_dim)).astype(np.float32)
    v = rng.standard_normal((n, head_dim)).astype(np.float32)
    k[3] = np.nan   # inside the first 8 keys of the chunk: the AVX2 lanes
    h.write(list(range(n)), k, v)
    q = rng.standard_normal((1, 2, head_dim)).astype(np.float32)
    got = h.paged(q, [n - 1], [0], np.array([[0]], np.int32), block_size, 0, 0.125)
    want = gathered_attention(q, k, v, [n - 1], 1, 0, 0.125)
    assert np.isnan(want).all() and np.isnan(got).all()
    h.close()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc's mallinfo2")
def test_the_kernel_allocates_nothing_while_it_runs():
    """Its tile memory is made with the context (here the harness): a step never
    mallocs on the hot path, where a failure could only abort the process."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2

    def heap_bytes():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    rng = np.random.default_rng(3)
    n_head, n_head_kv, head_dim, bs, n = 4, 1, 256, 16, 32
    h = AttentionHarness("f16", 4 * bs, n_head, n_head_kv, head_dim, n_threads=1)
    k = rng.standard_normal((4 * bs, head_dim)).astype(np.float32)
    h.write(range(4 * bs), k, k)
    q = rng.standard_normal((n, n_head, head_dim)).astype(np.float32)
    h.contiguous(q, 0, n, list(range(n)))           # GGML's graph buffer at the prefill's size
    tables = np.arange(4, dtype=np.int32).reshape(1, 4)
    h.paged(q[-1:], [n - 1], [0], tables, bs)       # a decode: one tile of 4 rows
    # A 32-token prefill needs tiles of 32 rows; the old kernel grew its buffer here.
    out = np.empty_like(q)
    pos = np.arange(n, dtype=np.int32)
    seqs = np.zeros(n, dtype=np.int32)
    b = ffi.new("pp_batch *")
    b.n_tokens, b.n_seqs, b.max_blocks_per_seq = n, 1, 4
    b.positions = ffi.cast("int32_t *", ffi.from_buffer(pos))
    b.seq_index = ffi.cast("int32_t *", ffi.from_buffer(seqs))
    b.block_tables = ffi.cast("int32_t *", ffi.from_buffer(tables))
    qp = ffi.cast("float *", ffi.from_buffer(q))
    op = ffi.cast("float *", ffi.from_buffer(out))
    before = heap_bytes()
    status = lib.pp_attention_harness_paged(h._h, b, bs, 0, head_dim ** -0.5, qp, op)
    grown = heap_bytes() - before
    assert status == 0 and np.isfinite(out).all()
    assert grown < 16 * 1024, f"the kernel allocated {grown} bytes during a step"
    h.close()


@pytest.mark.parametrize("kv_type,head_dim,n_head,n_head_kv,window,sinks", [
    ("f16", 64, 3, 1, 0, False),     # an odd GQA group: a tile pairs rows of different tokens
    ("f16", 128, 4, 2, 100, False),  # a sliding window: tiles start their keys anywhere
    ("q8_0", 64, 3, 1, 0, False),
    ("f16", 64, 4, 2, 0, True),      # sinks: counted once, whichever slice is first
])
def test_a_rows_output_is_the_same_bits_in_any_batch(kv_type, head_dim, n_head, n_head_kv, window, sinks):
    """Batch invariance (docs/batch-invariance.md): the last 40 queries of a 700-token
    sequence, computed as one prefill chunk, in chunks of 7 and 13 beside another sequence's
    queries, and one at a time (the split-K path on 1 to 3 threads), give every row the same
    bits."""
    rng = np.random.default_rng(head_dim + n_head + window)
    bs, length, n_q = 16, 700, 40
    num_blocks = 2 * (-(-length // bs)) + 2
    sink_values = rng.standard_normal(n_head).astype(np.float32) + 3.0
    results = []
    for n_threads in (1, 2, 3):
        h = AttentionHarness(kv_type, num_blocks * bs, n_head, n_head_kv, head_dim, n_threads=n_threads)
        if sinks:
            h.set_sinks(sink_values)
        state = np.random.default_rng(7)   # the same K/V, queries and tables for every thread count
        blocks, _, _ = scatter_sequence(state, h, length, bs, num_blocks, n_head_kv * head_dim, set())
        other, _, _ = scatter_sequence(state, h, 60, bs, num_blocks, n_head_kv * head_dim, set(blocks.tolist()))
        q = state.standard_normal((n_q, n_head, head_dim)).astype(np.float32)
        q_other = state.standard_normal((60, n_head, head_dim)).astype(np.float32)
        tables = np.full((2, len(blocks)), -1, np.int32)
        tables[0] = blocks
        tables[1, :len(other)] = other
        positions = list(range(length - n_q, length))
        whole = h.paged(q, positions, [0] * n_q, tables, bs, window)
        results.append(whole)
        for chunk in (7, 13):   # this sequence's chunks after another's queries in the same call
            parts = []
            for c in range(0, n_q, chunk):
                m = min(chunk, n_q - c)
                qq = np.concatenate([q_other[:5], q[c:c + m]])
                out = h.paged(qq, list(range(55, 60)) + positions[c:c + m], [1] * 5 + [0] * m, tables, bs, window)
                parts.append(out[5:])
            results.append(np.concatenate(parts))
        results.append(np.concatenate([h.paged(q[i:i + 1], positions[i:i + 1], [0], tables, bs, window)
                                       for i in range(n_q)]))
    for got in results[1:]:
        assert np.array_equal(got.view(np.uint32), results[0].view(np.uint32))
