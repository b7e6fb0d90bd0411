/* The panel GEMM outside any model (pyllama_paged_testing.h): for checking
 * each kernel against GGML's dequantized products and for benchmarks. */
#include "pyllama_paged_testing.h"
#include "common/pp_internal.h"
#include "panels/panel_formats.h"

#include <stdlib.h>
#include <string.h>

static int quantizable(int32_t type, int64_t k) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size((enum ggml_type)type) <= 0) return 0;
    const struct ggml_type_traits *t = ggml_get_type_traits((enum ggml_type)type);
    return t->to_float && k > 0 && k % ggml_blck_size((enum ggml_type)type) == 0;
}

int32_t pp_ggml_quantize_rows(int32_t type, const float *src, int64_t n_rows, int64_t k, void *dst) {
    if (!src || !dst || n_rows <= 0 || !quantizable(type, k) || ggml_quantize_requires_imatrix((enum ggml_type)type))
        return pp_fail(PP_ERR_INVALID, "pp_ggml_quantize_rows: GGML cannot quantize %lld values per row to type %d",
                       (long long)k, (int)type);
    ggml_quantize_init((enum ggml_type)type);
    ggml_quantize_chunk((enum ggml_type)type, src, dst, 0, n_rows, k, NULL);
    return PP_OK;
}

int32_t pp_ggml_dequantize_rows(int32_t type, const void *src, int64_t n_rows, int64_t k, float *dst) {
    if (!src || !dst || n_rows <= 0 || !quantizable(type, k))
        return pp_fail(PP_ERR_INVALID, "pp_ggml_dequantize_rows: no dequantization of type %d for rows of %lld",
                       (int)type, (long long)k);
    const struct ggml_type_traits *t = ggml_get_type_traits((enum ggml_type)type);
    t->to_float(src, dst, n_rows * k);
    return PP_OK;
}

int64_t pp_ggml_row_bytes(int32_t type, int64_t k) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size((enum ggml_type)type) <= 0 || k <= 0 ||
        k % ggml_blck_size((enum ggml_type)type))
        return -1;
    return (int64_t)ggml_row_size((enum ggml_type)type, k);
}

int32_t pp_panel_kernel_available(int32_t kernel) {
    return kernel >= PP_PANEL_KERNEL_SCALAR && kernel <= PP_PANEL_KERNEL_AVX2 &&
           pp_panel_kernel_runs_here((enum pp_panel_kernel)kernel);
}

int32_t pp_panel_bf16_dot_available(void) {
    return pp_panel_kernel_runs_here(PP_PANEL_KERNEL_AVX512VNNI) && pp_fpanel_bf16_dot_runs_here();
}

/* The weight packed for kernel into *out; a status. */
static int32_t pack_checked(int32_t type, int64_t k, int64_t n_rows, const void *weight, int32_t kernel,
                            pp_q8_panels **out) {
    if (kernel < PP_PANEL_KERNEL_SCALAR || kernel > PP_PANEL_KERNEL_AVX2 ||
        !pp_panel_kernel_runs_here((enum pp_panel_kernel)kernel))
        return pp_fail(PP_ERR_INVALID, "panel kernel %d does not run on this CPU", (int)kernel);
    if (!weight || type < 0 || type >= GGML_TYPE_COUNT ||
        !pp_q8_panels_fit((enum ggml_type)type, k, n_rows, (enum pp_panel_kernel)kernel))
        return pp_fail(PP_ERR_INVALID, "the panels do not take a [%lld, %lld] weight of type %d for kernel %d",
                       (long long)k, (long long)n_rows, (int)type, (int)kernel);
    *out = pp_q8_panels_pack(weight, (enum ggml_type)type, k, n_rows);
    if (!*out)
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the panels of a [%lld, %lld] weight", (long long)k,
                       (long long)n_rows);
    return PP_OK;
}

int32_t pp_panel_gemm_run(int32_t type, int64_t k, int64_t n_rows, const void *weight, const float *x,
                          int64_t n, int32_t kernel, float *out) {
    if (!x || !out || n <= 0) return pp_fail(PP_ERR_INVALID, "pp_panel_gemm_run: no columns");
    pp_q8_panels *p = NULL;
    const int32_t status = pack_checked(type, k, n_rows, weight, kernel, &p);
    if (status != PP_OK) return status;
    if (pp_panel_type_is_float((enum ggml_type)type)) {   /* the kernels read the f32 columns */
        pp_panel_kernel_for((enum pp_panel_kernel)kernel, (enum ggml_type)type)(
            p, 0, n_rows / PP_PANEL_ROWS, (const uint8_t *)x, (size_t)k * sizeof(float), n, out, (size_t)n_rows);
        pp_q8_panels_free(p);
        return PP_OK;
    }
    const size_t stride = pp_panel_column_bytes(k);
    uint8_t *cols = malloc(stride * (size_t)n);
    if (!cols) {
        pp_q8_panels_free(p);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate %lld quantized columns", (long long)n);
    }
    const pp_panel_quantize_fn quantize = pp_panel_quantizer_for((enum pp_panel_kernel)kernel);
    for (int64_t c = 0; c < n; c++) quantize(x + c * k, k, cols + (size_t)c * stride);
    pp_panel_kernel_for((enum pp_panel_kernel)kernel, (enum ggml_type)type)(p, 0, n_rows / PP_PANEL_ROWS, cols,
                                                                            stride, n, out, (size_t)n_rows);
    free(cols);
    pp_q8_panels_free(p);
    return PP_OK;
}

int32_t pp_panel_row_run(int32_t type, int64_t k, int64_t n_rows, const void *weight, int64_t row, float *out) {
    if (!out || row < 0 || row >= n_rows) return pp_fail(PP_ERR_INVALID, "pp_panel_row_run: row %lld outside the weight",
                                                         (long long)row);
    pp_q8_panels *p = NULL;
    const int32_t status = pack_checked(type, k, n_rows, weight, PP_PANEL_KERNEL_SCALAR, &p);
    if (status != PP_OK) return status;
    pp_q8_panels_row(p, row, out);
    pp_q8_panels_free(p);
    return PP_OK;
}

int64_t pp_panel_chunks_run(int64_t n_panels, int32_t n_threads, int64_t chunk, const int32_t *schedule,
                            int32_t n_schedule, int64_t *claims, int64_t max_claims) {
    if (n_panels < 0 || n_threads < 1 || n_threads > PP_PANEL_MAX_RANGES || chunk < 1 || n_schedule < 0 ||
        (n_schedule > 0 && !schedule) || !claims || max_claims < 0) {
        pp_fail(PP_ERR_INVALID, "pp_panel_chunks_run: bad arguments");
        return -1;
    }
    /* a weight of n_panels panels (no data: only the sharing is run) */
    pp_q8_panels w = {.type = GGML_TYPE_Q8_0, .n_rows = n_panels * PP_PANEL_ROWS, .k = PP_PANEL_BLOCK};
    pp_panel_gemm_state *st = aligned_alloc(_Alignof(pp_panel_gemm_state), sizeof *st);
    if (!st) {
        pp_fail(PP_ERR_NO_MEMORY, "pp_panel_chunks_run: no memory");
        return -1;
    }
    memset(st, 0, sizeof *st);
    st->w = &w;
    pp_panel_gemm_rearm(st, 1, n_threads);
    int cursor[PP_PANEL_MAX_RANGES] = {0}, listed[PP_PANEL_MAX_RANGES] = {0};
    int64_t n = 0;
    for (int32_t i = 0; i < n_schedule; i++) {
        if (schedule[i] < 0 || schedule[i] >= n_threads) {
            free(st);
            pp_fail(PP_ERR_INVALID, "pp_panel_chunks_run: thread %d outside %d", schedule[i], n_threads);
            return -1;
        }
        listed[schedule[i]] = 1;
    }
    for (int32_t i = 0; i < n_schedule + n_threads; i++) {
        const int t = i < n_schedule ? schedule[i] : i - n_schedule;
        if (!listed[t]) continue;
        int64_t p0, p1;
        while (pp_panel_next_chunk(st, t, n_threads, n_panels, chunk, &cursor[t], &p0, &p1)) {
            if (n == max_claims) {
                free(st);
                pp_fail(PP_ERR_INVALID, "pp_panel_chunks_run: more than %lld chunks", (long long)max_claims);
                return -1;
            }
            claims[3 * n] = t;
            claims[3 * n + 1] = p0;
            claims[3 * n + 2] = p1;
            n++;
            if (i < n_schedule) break;   /* one request per schedule entry */
        }
    }
    free(st);
    return n;
}
