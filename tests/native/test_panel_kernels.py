"""Each panel GEMM kernel against GGML's own dequantized products, on real-shaped random weights.

The weights are quantized by GGML (pp_ggml_quantize_rows) and dequantized by GGML; the kernels
see the same bytes packed into panels. The activations are quantized per 32 values as the graph
does (int8, fp16 scale amax / 127, round half to even), reproduced here in NumPy, so the float64
product of the two dequantized operands is what the kernel computes up to float32 rounding: the
tolerance is 1e-6 of sum |w| |x| per output (seen: 4e-8). A wrong code, scale, min or offset is off by far more.
Against the unquantized activations the error is the activation rounding's (stated below)."""

import numpy as np
import pytest

from pyllama_paged._native import ffi, lib

TYPES = {"q8_0": 8, "q5_0": 6, "q4_0": 2, "q4_k": 12, "q5_k": 13, "q6_k": 14, "mxfp4": 39}   # GGML's type ids
FLOAT_TYPES = {"f16": 1, "bf16": 30}   # float panels: f32 activations, f32 FMAs
KERNELS = {"portable": lib.PP_PANEL_KERNEL_SCALAR, "avx2": lib.PP_PANEL_KERNEL_AVX2,
           "avx-vnni": lib.PP_PANEL_KERNEL_AVXVNNI, "avx512-vnni": lib.PP_PANEL_KERNEL_AVX512VNNI}
# (k, rows): a 2048-wide projection, Llama 3.2's 8192-wide ffn_down, Gemma 3 4B's 10240-wide one,
# and an odd count of panels (three)
SHAPES = [(2048, 64), (8192, 16), (10240, 8), (1280, 24)]
# gpt-oss's expert matrices: 2880 wide, not whole 256-value superblocks (MXFP4 blocks are 32)
MXFP4_SHAPES = [(2880, 24)]
# every tile width of both K-panel paths: straight from the stored panel (1, 2 and 4 columns; below
# 20 columns with AVX-512 VNNI, below 8 otherwise) and widened (8 or 4, then 4 and 1), and remainders;
# MXFP4 panels' straight tiles (below 16 columns: 8 or 4, 4, 1) and widened ones likewise
COLUMNS = [1, 3, 4, 8, 13, 21, 29]


def _weights(rng, n_rows: int, k: int) -> np.ndarray:
    # rows of different magnitudes and a few outliers, as trained weights have
    w = rng.standard_normal((n_rows, k)).astype(np.float32) * rng.uniform(0.005, 0.05, (n_rows, 1)).astype(np.float32)
    w[rng.random((n_rows, k)) < 1e-3] *= 8
    return w


def ggml_quantize(w: np.ndarray, type_name: str) -> tuple[bytes, np.ndarray]:
    """w's rows in GGML's type_name bytes, and those bytes dequantized by GGML."""
    n_rows, k = w.shape
    w = np.ascontiguousarray(w, dtype=np.float32)
    type_id = {**TYPES, **FLOAT_TYPES}[type_name]
    row_bytes = lib.pp_ggml_row_bytes(type_id, k)
    data = ffi.new("uint8_t[]", row_bytes * n_rows)
    assert lib.pp_ggml_quantize_rows(type_id, ffi.from_buffer("float[]", w), n_rows, k, data) == 0
    back = np.empty_like(w)
    assert lib.pp_ggml_dequantize_rows(type_id, data, n_rows, k, ffi.from_buffer("float[]", back)) == 0
    return bytes(ffi.buffer(data)), back


def quantize_columns(x: np.ndarray) -> np.ndarray:
    """The activations as the kernels see them, dequantized (float64)."""
    n, k = x.shape
    blocks = x.reshape(n, k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float64)
    return (q.astype(np.float64) * d).reshape(n, k)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to BF16, to nearest even (as f32)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def panel_gemm(data: bytes, type_name: str, k: int, n_rows: int, x: np.ndarray, kernel: str) -> np.ndarray:
    out = np.empty((x.shape[0], n_rows), np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    type_id = {**TYPES, **FLOAT_TYPES}[type_name]
    status = lib.pp_panel_gemm_run(type_id, k, n_rows, data, ffi.from_buffer("float[]", x), x.shape[0],
                                   KERNELS[kernel], ffi.from_buffer("float[]", out))
    assert status == 0, ffi.string(lib.pp_last_error()).decode()
    return out


def runs_here(kernel: str) -> bool:
    return bool(lib.pp_panel_kernel_available(KERNELS[kernel]))


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("type_name", list(TYPES))
def test_kernels_match_ggml_dequantized_products(type_name, kernel):
    if not runs_here(kernel):
        pytest.skip(f"this CPU has no {kernel}")
    if kernel == "avx2" and type_name in ("q8_0", "q5_0", "q4_0"):
        pytest.skip("the AVX2 kernel takes K-quant and MXFP4 panels only")
    rng = np.random.default_rng(7)
    for k, n_rows in SHAPES + (MXFP4_SHAPES if type_name == "mxfp4" else []):
        if type_name in ("q5_0", "q4_0", "mxfp4") and k > 8192:
            continue   # Q5_0, Q4_0 and MXFP4 panels widen a whole row on the stack (PP_PANEL_MAX_K)
        w = _weights(rng, n_rows, k)
        data, w_ggml = ggml_quantize(w, type_name)
        for n in COLUMNS:
            x = rng.standard_normal((n, k)).astype(np.float32)
            got = panel_gemm(data, type_name, k, n_rows, x, kernel).astype(np.float64)
            xq = quantize_columns(x)
            want = xq @ w_ggml.astype(np.float64).T
            scale = np.abs(xq) @ np.abs(w_ggml.astype(np.float64)).T
            err = np.abs(got - want) / scale
            assert err.max() < 1e-6, (k, n_rows, n, float(err.max()))
            # the activations' own rounding: under 1% of sum |w| |x| (seen ~0.1%)
            exact = x.astype(np.float64) @ w_ggml.astype(np.float64).T
            assert (np.abs(got - exact) / scale).max() < 1e-2


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("type_name", list(FLOAT_TYPES))
def test_float_kernels_match_the_exact_product(type_name, kernel):
    """F16 and BF16 panels multiply the f32 activations unrounded: against the float64 product of
    GGML's dequantized weights and the activations, f32 accumulation error only (every tile
    width and remainder of both SIMD kernels: 12, 8, 4, 2, 1 and 3, 2, 1 columns). BF16 panels
    on AVX-512 BF16 dot products take the activations rounded to BF16 (nearest even), as
    GGML's BF16 products do: against that product."""
    if not runs_here(kernel):
        pytest.skip(f"this CPU has no {kernel}")
    rounded = type_name == "bf16" and kernel == "avx512-vnni" and lib.pp_panel_bf16_dot_available()
    rng = np.random.default_rng(11)
    for k, n_rows in SHAPES + [(640, 40)]:
        w = _weights(rng, n_rows, k)
        data, w_ggml = ggml_quantize(w, type_name)
        for n in COLUMNS + [12, 27]:
            x = rng.standard_normal((n, k)).astype(np.float32)
            got = panel_gemm(data, type_name, k, n_rows, x, kernel).astype(np.float64)
            xs = round_bf16(x) if rounded else x
            want = xs.astype(np.float64) @ w_ggml.astype(np.float64).T
            scale = np.abs(xs.astype(np.float64)) @ np.abs(w_ggml.astype(np.float64)).T
            err = np.abs(got - want) / scale
            assert err.max() < 1e-5, (k, n_rows, n, float(err.max()))


@pytest.mark.parametrize("type_name", ["q4_k", "q5_k", "q6_k", "q8_0", "q5_0", "q4_0", "mxfp4", "f16", "bf16"])
def test_a_packed_row_reads_back_as_ggml_dequantizes_it(type_name):
    """A tied head's rows are the input embedding: each packed row is GGML's dequantized row, bit
    for bit."""
    rng = np.random.default_rng(3)
    k, n_rows = 2048, 16
    data, w_ggml = ggml_quantize(_weights(rng, n_rows, k), type_name)
    for row in (0, 5, 15):
        out = np.empty(k, np.float32)
        type_id = {**TYPES, **FLOAT_TYPES}[type_name]
        assert lib.pp_panel_row_run(type_id, k, n_rows, data, row, ffi.from_buffer("float[]", out)) == 0
        assert np.array_equal(out, w_ggml[row])


# E8M0 exponents: the f32 denormals 2^-128 and 2^-127 (0 and 1, formed apart by the SIMD
# kernels), the smallest normals, and up to a scale of 2^29
MXFP4_EXPONENTS = [0, 1, 2, 3, 64, 120, 127, 157]


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_mxfp4_scales_from_denormal_to_large_are_ggml_dequantized_ones(kernel):
    """Rows of MXFP4 blocks written byte by byte, each row one exponent of MXFP4_EXPONENTS and
    every one of the 16 codes drawn: the packed rows read back as GGML dequantizes them, bit for
    bit, and each kernel's products (straight and widened tiles) are those of GGML's dequantized
    weights, as for any exponent, however small or large the scale."""
    if not runs_here(kernel):
        pytest.skip(f"this CPU has no {kernel}")
    rng = np.random.default_rng(13)
    k, n_rows = 512, 16
    nb = k // 32
    exponents = np.repeat(np.array(MXFP4_EXPONENTS * 2, np.uint8)[:, None, None], nb, axis=1)
    codes = rng.integers(0, 256, size=(n_rows, nb, 16), dtype=np.uint8)
    data = np.concatenate([exponents, codes], axis=-1).tobytes()
    w = np.empty((n_rows, k), np.float32)
    assert lib.pp_ggml_dequantize_rows(TYPES["mxfp4"], data, n_rows, k, ffi.from_buffer("float[]", w)) == 0
    assert np.all(np.isfinite(w)) and (w[0] != 0).any() and np.abs(w[0]).max() < 1e-36
    for row in range(n_rows):
        out = np.empty(k, np.float32)
        assert lib.pp_panel_row_run(TYPES["mxfp4"], k, n_rows, data, row, ffi.from_buffer("float[]", out)) == 0
        assert np.array_equal(out, w[row]), row
    w64 = w.astype(np.float64)
    for n in (1, 5, 21):
        x = rng.standard_normal((n, k)).astype(np.float32)
        got = panel_gemm(data, "mxfp4", k, n_rows, x, kernel).astype(np.float64)
        xq = quantize_columns(x)
        err = np.abs(got - xq @ w64.T) / (np.abs(xq) @ np.abs(w64).T)
        assert err.max() < 1e-6, (n, float(err.max()), err.max(axis=0))


def test_shapes_the_panels_do_not_take_are_refused():
    rng = np.random.default_rng(0)
    data, _ = ggml_quantize(_weights(rng, 8, 256), "q4_k")
    x = np.zeros((1, 256), np.float32)
    out = np.empty(12, np.float32)
    # 12 rows: not whole 8-row panels
    assert lib.pp_panel_gemm_run(TYPES["q4_k"], 256, 12, data, ffi.from_buffer("float[]", x), 1,
                                 lib.PP_PANEL_KERNEL_SCALAR, ffi.from_buffer("float[]", out)) == lib.PP_ERR_INVALID
    assert "do not take" in ffi.string(lib.pp_last_error()).decode()
    assert lib.pp_panel_row_run(TYPES["q4_k"], 256, 8, data, 8, ffi.from_buffer("float[]", out)) == lib.PP_ERR_INVALID
    assert lib.pp_panel_gemm_run(TYPES["q4_k"], 256, 8, data, ffi.from_buffer("float[]", x), 1, 99,
                                 ffi.from_buffer("float[]", out)) == lib.PP_ERR_INVALID
    # MXFP4 rows longer than a widened panel on the stack holds (PP_PANEL_MAX_K): GGML's products
    k = 8192 + 32
    data, _ = ggml_quantize(_weights(rng, 8, k), "mxfp4")
    x = np.zeros((1, k), np.float32)
    assert lib.pp_panel_gemm_run(TYPES["mxfp4"], k, 8, data, ffi.from_buffer("float[]", x), 1,
                                 lib.PP_PANEL_KERNEL_SCALAR, ffi.from_buffer("float[]", out)) == lib.PP_ERR_INVALID
    assert "do not take" in ffi.string(lib.pp_last_error()).decode()


def _chunks(n_panels, n_threads, chunk, schedule):
    claims = np.zeros((4 * n_panels + 8, 3), dtype=np.int64)
    sched = np.asarray(schedule, dtype=np.int32)
    n = lib.pp_panel_chunks_run(n_panels, n_threads, chunk, ffi.from_buffer("int32_t[]", sched), len(sched),
                                ffi.from_buffer("int64_t[]", claims), len(claims))
    assert n >= 0
    return [tuple(int(v) for v in row) for row in claims[:n]]


def _covered_once(claims, n_panels):
    seen = np.zeros(n_panels, dtype=int)
    for _, p0, p1 in claims:
        seen[p0:p1] += 1
    return (seen == 1).all()


@pytest.mark.parametrize("n_threads", [1, 2, 3, 16])
def test_each_thread_streams_its_own_range_of_panels_in_order(n_threads):
    """Running in turn, each thread's chunks are one contiguous ascending run (its bytes in
    order, which a decode step's small projections need), and every panel is computed once."""
    n_panels = 1000
    claims = _chunks(n_panels, n_threads, 7, list(range(n_threads)) * 400)
    assert _covered_once(claims, n_panels)
    for t in range(n_threads):
        mine = [(p0, p1) for th, p0, p1 in claims if th == t]
        assert mine[0][0] == n_panels * t // n_threads
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
        assert mine[-1][1] == n_panels * (t + 1) // n_threads


def test_a_thread_the_os_never_ran_holds_up_nothing():
    """Thread 1 never runs: thread 0 takes its whole range, chunk by chunk from the back,
    after its own; with thread 1 running late, it loses only what thread 0 took."""
    n_panels, chunk = 100, 8
    alone = _chunks(n_panels, 2, chunk, [0])
    assert {t for t, _, _ in alone} == {0} and _covered_once(alone, n_panels)
    stolen = [(p0, p1) for _, p0, p1 in alone if p0 >= 50]
    assert stolen[0] == (42 + 50, 100) and all(p1 - p0 <= chunk for p0, p1 in stolen)
    late = _chunks(n_panels, 2, chunk, [0] * 9 + [1])   # thread 0 done with its own, one steal, then 1 runs
    assert _covered_once(late, n_panels)
    assert [c for c in late if c[0] == 1][0] == (1, 50, 58)   # its range's front, untouched
