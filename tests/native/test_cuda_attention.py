"""The CUDA paged-attention decode kernel (native/cuda/) against a NumPy
softmax(QK^T)V on the gathered K/V: shuffled pages, lengths that are not
multiples of the block, windows, pages shared by two sequences, GQA, split-K.
Compiles wherever nvcc is; runs only with a GPU (skipped otherwise)."""

from pathlib import Path

import numpy as np
import pytest

from pyllama_paged.testing.cuda_harness import CudaHarness, build

CUDA_SOURCES = Path(__file__).resolve().parents[2] / "native" / "cuda"


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    path = build(tmp_path_factory.mktemp("cuda"), CUDA_SOURCES)
    if path is None:
        pytest.skip("nvcc is not installed")
    h = CudaHarness(path)
    if h.devices == 0:
        pytest.skip("no CUDA device")
    return h


def test_the_cuda_source_compiles(tmp_path):
    if build(tmp_path, CUDA_SOURCES) is None:
        pytest.skip("nvcc is not installed")
    assert (tmp_path / "libpp_cuda_attention.so").stat().st_size > 0


def reference(q, k_pool, v_pool, tables, lens, bs, window, scale):
    n_seqs, n_head, hd = q.shape
    n_kv = k_pool.shape[1]
    out = np.zeros_like(q)
    for s in range(n_seqs):
        keys = np.arange(lens[s])
        if window:
            keys = keys[keys > lens[s] - 1 - window]
        slots = tables[s][keys // bs] * bs + keys % bs
        k, v = k_pool[slots].astype(np.float32), v_pool[slots].astype(np.float32)
        for h in range(n_head):
            kvh = h // (n_head // n_kv)
            scores = k[:, kvh] @ q[s, h] * scale
            p = np.exp(scores - scores.max())
            out[s, h] = p @ v[:, kvh] / p.sum()
    return out


@pytest.mark.parametrize("hd,n_head,n_kv,window,part", [(256, 4, 1, 0, 0), (128, 8, 2, 0, 64),
                                                         (64, 4, 4, 0, 0), (256, 4, 1, 100, 0),
                                                         (128, 16, 2, 0, 128)])
def test_decode_matches_numpy_on_shuffled_shared_pages(harness, hd, n_head, n_kv, window, part):
    rng = np.random.default_rng(hd + n_head + window + part)
    bs, lens = 16, np.array([1, 17, 300, 1000, 513])
    max_blocks = -(-lens.max() // bs)
    num_blocks = sum(-(-n // bs) for n in lens) + 7
    perm = rng.permutation(num_blocks)
    tables, at = np.full((len(lens), max_blocks), -1, np.int32), 0
    for s, n in enumerate(lens):
        nb = -(-n // bs)
        tables[s, :nb] = perm[at:at + nb]
        at += nb
    tables[4, :10] = tables[3, :10]                 # sequence 4 shares its first pages with 3
    k_pool = rng.standard_normal((num_blocks * bs, n_kv, hd)).astype(np.float16)
    v_pool = rng.standard_normal((num_blocks * bs, n_kv, hd)).astype(np.float16)
    q = rng.standard_normal((len(lens), n_head, hd)).astype(np.float32)
    scale = 1 / np.sqrt(hd)
    got, _ = harness.decode(q, k_pool, v_pool, tables, lens, bs, window, scale, part)
    want = reference(q, k_pool, v_pool, tables, lens, bs, window, scale)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)


def test_bad_shapes_are_refused(harness):
    with pytest.raises(RuntimeError, match="head_dim 96"):
        harness.decode(np.zeros((1, 4, 96)), np.zeros((16, 1, 96)), np.zeros((16, 1, 96)),
                       np.zeros((1, 1)), [1], 16)
