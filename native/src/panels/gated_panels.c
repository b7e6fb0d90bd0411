/* A dense FFN's gate and up products in one op, the gated activation applied
 * as their rows come out (panels.h: pp_panel_gated). Apart, a decode step ran
 * gate, up and the activation as three ops: two more barriers per layer, and
 * an activation GGML splits by rows, i.e. one thread for a single token's
 * row while the others waited. Here each thread takes a chunk of panels,
 * runs both kernels into its tiles and writes act(gate) * up for those rows.
 * One op at every width keeps a step's graph the same shape whatever the
 * number of sequences. */
#include "panels/panel_formats.h"

#include <math.h>
#include <stdatomic.h>

#if defined(__x86_64__)
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "kernels/vec_exp.h"
#pragma GCC pop_options
#endif

/* Each thread's two tiles (gate's and up's rows of a chunk, column by
 * column) hold GATED_TILE_FLOATS: a decode chunk of up to 32 panels, a
 * prefill chunk of fewer panels over up to GATED_TILE_FLOATS / 8 columns at
 * a time. */
#define GATED_CHUNK_PANELS 32
#define GATED_TILE_FLOATS 16384

static _Thread_local _Alignas(64) float gated_tile[2][GATED_TILE_FLOATS];

/* GELU's tanh form, 0.5 x (1 + tanh(y)) with y = sqrt(2 / pi) (x + 0.044715 x^3),
 * is x * sigmoid(2 y); SiLU is x * sigmoid(x). */
#define GELU_2C 1.5957691216057308f   /* 2 sqrt(2 / pi) */

static inline float gate_arg(float x, int gelu) {
    return gelu ? GELU_2C * (x + 0.044715f * x * x * x) : x;
}

static void gated_rows_portable(float *out, const float *gate, const float *up, int64_t n, int gelu) {
    for (int64_t i = 0; i < n; i++) {
        const float x = gate[i];
        out[i] = x / (1.0f + expf(-gate_arg(x, gelu))) * up[i];
    }
}

#if defined(__x86_64__)
/* sigmoid(z) from e = exp(-|z|): 1 / (1 + e) for z >= 0, e / (1 + e) below */
__attribute__((target("avx2,fma"))) static void gated_rows_avx2(float *out, const float *gate, const float *up,
                                                                 int64_t n, int gelu) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(gate + i);
        __m256 z = x;
        if (gelu) {
            const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            z = _mm256_mul_ps(_mm256_set1_ps(GELU_2C), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
        }
        const __m256 e = pp_exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_and_ps(z, abs_mask)));
        const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 s = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, s), _mm256_loadu_ps(up + i)));
    }
    gated_rows_portable(out + i, gate + i, up + i, n - i, gelu);
}
#endif

static void gated_op(struct ggml_tensor *dst, int ith, int nth, pp_panel_gemm_state *gate, int gelu) {
    const pp_panel_gemm_state *up = gate + 1;
    const struct ggml_tensor *cols = dst->src[0];
    const pp_panel_kernel_fn fn_gate = pp_panel_kernel_for(gate->kernel, gate->w->type);
    const pp_panel_kernel_fn fn_up = pp_panel_kernel_for(up->kernel, up->w->type);
    const int64_t k = gate->w->k, n_rows = gate->w->n_rows, n_panels = n_rows / PP_PANEL_ROWS, n = cols->ne[1];
    const size_t gate_panel = pp_q8_panels_bytes(gate->w->type, k, PP_PANEL_ROWS);
    const size_t up_panel = pp_q8_panels_bytes(up->w->type, k, PP_PANEL_ROWS);
    const int64_t block = n < GATED_TILE_FLOATS / PP_PANEL_ROWS ? n : GATED_TILE_FLOATS / PP_PANEL_ROWS;
    int64_t chunk = n_panels / (8 * (int64_t)nth), fits = GATED_TILE_FLOATS / (PP_PANEL_ROWS * block);
    chunk = chunk > GATED_CHUNK_PANELS ? GATED_CHUNK_PANELS : chunk;
    chunk = chunk > fits ? fits : chunk < 1 ? 1 : chunk;
#if defined(__x86_64__)
    void (*rows_fn)(float *, const float *, const float *, int64_t, int) =
        gate->kernel == PP_PANEL_KERNEL_SCALAR ? gated_rows_portable : gated_rows_avx2;
#else
    void (*rows_fn)(float *, const float *, const float *, int64_t, int) = gated_rows_portable;
#endif
    const size_t ldd = dst->nb[1] / sizeof(float);
    float *out = dst->data;
    int cursor = 0;
    int64_t p0, p1;
    while (pp_panel_next_chunk(gate, ith, nth, n_panels, chunk, &cursor, &p0, &p1)) {
        const int64_t rows = (p1 - p0) * PP_PANEL_ROWS;
        /* the kernels address panels by index from data: a header that starts at the chunk
         * puts its rows at the top of the tiles */
        pp_q8_panels g = *gate->w, u = *up->w;
        g.data += (size_t)p0 * gate_panel;
        u.data += (size_t)p0 * up_panel;
        g.n_rows = u.n_rows = rows;
        for (int64_t c0 = 0; c0 < n; c0 += block) {
            const int64_t nc = n - c0 < block ? n - c0 : block;
            const uint8_t *cc = (const uint8_t *)cols->data + (size_t)c0 * cols->nb[1];
            fn_gate(&g, 0, p1 - p0, cc, cols->nb[1], nc, gated_tile[0], (size_t)rows);
            fn_up(&u, 0, p1 - p0, cc, cols->nb[1], nc, gated_tile[1], (size_t)rows);
            for (int64_t c = 0; c < nc; c++)
                rows_fn(out + (size_t)(c0 + c) * ldd + p0 * PP_PANEL_ROWS, gated_tile[0] + c * rows,
                        gated_tile[1] + c * rows, rows, gelu);
        }
    }
}

static void gated_gelu_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    gated_op(dst, ith, nth, userdata, 1);
}

static void gated_silu_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    gated_op(dst, ith, nth, userdata, 0);
}

int pp_panel_gated_takes(const pp_panel_gemm_state *gate_up) {
    const pp_q8_panels *g = gate_up[0].w, *u = gate_up[1].w;
    return g && u && g->k == u->k && g->n_rows == u->n_rows &&
           pp_panel_type_is_float(g->type) == pp_panel_type_is_float(u->type) && gate_up[0].kernel == gate_up[1].kernel;
}

struct ggml_tensor *pp_panel_gated(struct ggml_context *ctx, pp_panel_gemm_state *gate_up, struct ggml_tensor *cols,
                                   int gelu) {
    GGML_ASSERT(pp_panel_gated_takes(gate_up));
    return ggml_custom_4d(ctx, GGML_TYPE_F32, gate_up[0].w->n_rows, cols->ne[1], 1, 1, &cols, 1,
                          gelu ? gated_gelu_op : gated_silu_op, GGML_N_TASKS_MAX, gate_up);
}
