/* Q8_0 row panels (see q8_panels.h): packing, the portable kernel, the two
 * graph ops around the kernels, and the tied input embedding read back from
 * the panels. The VNNI kernels are in q8_panel_kernels.c. */
#include "q8_panels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define PP_PANEL_CHUNK 32   /* most panels a thread takes at a time (see chunk_panels) */

enum pp_panel_kernel pp_panel_kernel_select(void) {
    const char *forced = getenv("PYLLAMA_PAGED_KERNELS");
    if (forced && strcmp(forced, "generic") == 0) return PP_PANEL_KERNEL_SCALAR;
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
    /* PYLLAMA_PAGED_KERNELS=avx2: the kernel of CPUs without VNNI, on one with it (tests) */
    if (forced && strcmp(forced, "avx2") == 0 && avx2) return PP_PANEL_KERNEL_AVX2;
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512f") && avx2)
        return PP_PANEL_KERNEL_AVX512VNNI;
    if (__builtin_cpu_supports("avxvnni") && avx2) return PP_PANEL_KERNEL_AVXVNNI;
    if (avx2) return PP_PANEL_KERNEL_AVX2;
#endif
    return PP_PANEL_KERNEL_NONE;
}

int pp_panel_kernel_runs_here(enum pp_panel_kernel k) {
    if (k == PP_PANEL_KERNEL_SCALAR) return 1;
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
    if (k == PP_PANEL_KERNEL_AVX2) return avx2;
    if (k == PP_PANEL_KERNEL_AVXVNNI) return avx2 && __builtin_cpu_supports("avxvnni");
    if (k == PP_PANEL_KERNEL_AVX512VNNI)
        return avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f");
#endif
    return 0;
}

pp_panel_kernel_fn pp_panel_kernel_for(enum pp_panel_kernel k, enum ggml_type type) {
    if (pp_panel_type_is_float(type)) {
#if defined(__x86_64__)
        if (k == PP_PANEL_KERNEL_AVX512VNNI)
            return type == GGML_TYPE_BF16 ? pp_fpanel_gemm_bf16_avx512vnni : pp_fpanel_gemm_avx512vnni;
        if (k == PP_PANEL_KERNEL_AVXVNNI || k == PP_PANEL_KERNEL_AVX2) return pp_fpanel_gemm_avx2;
#endif
        return pp_fpanel_gemm_scalar;
    }
    if (pp_panel_type_is_k(type)) {
#if defined(__x86_64__)
        if (k == PP_PANEL_KERNEL_AVX512VNNI) return pp_kpanel_gemm_avx512vnni;
        if (k == PP_PANEL_KERNEL_AVXVNNI) return pp_kpanel_gemm_avxvnni;
        if (k == PP_PANEL_KERNEL_AVX2) return pp_kpanel_gemm_avx2;
#endif
        return pp_kpanel_gemm_scalar;
    }
#if defined(__x86_64__)
    if (k == PP_PANEL_KERNEL_AVX512VNNI) return pp_panel_gemm_avx512vnni;
    if (k == PP_PANEL_KERNEL_AVXVNNI) return pp_panel_gemm_avxvnni;
#endif
    return pp_panel_gemm_scalar;
}

int pp_q8_panels_fit(enum ggml_type type, int64_t k, int64_t n_rows, enum pp_panel_kernel kernel) {
    if (k <= 0 || n_rows <= 0 || k % PP_PANEL_BLOCK || n_rows % PP_PANEL_ROWS) return 0;
    if (pp_panel_type_is_k(type)) return k % PP_PANEL_KBLOCK == 0 && k <= PP_PANEL_K_MAX_K;
    if (pp_panel_type_is_float(type)) return 1;
    if (kernel == PP_PANEL_KERNEL_AVX2) return 0;
    return type == GGML_TYPE_Q8_0 || ((type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q4_0) && k <= PP_PANEL_MAX_K);
}

static size_t panel_block_bytes(enum ggml_type type) {
    return type == GGML_TYPE_Q5_0 ? PP_PANEL_Q5_BLOCK_BYTES
         : type == GGML_TYPE_Q4_0 ? PP_PANEL_Q4_BLOCK_BYTES : PP_PANEL_BLOCK_BYTES;
}

/* One row's 32-value block into its panel-block (row r), as whole 4-byte
 * groups: panel value i = 32j + 4r + e is the row's value t = 4j + e.
 * Q8_0: code q + 128 in byte i. Q4_0 and Q5_0: byte i % 128 holds value i's
 * nibble (low for i < 128, high above), which is exactly GGML's nibble byte
 * t % 16 of the row (value t low, t + 16 high); Q5_0's fifth bits go to bit
 * i of bytes 144... */
static void pack_block_row(enum ggml_type type, const uint8_t *blk, int r, uint8_t *dst) {
    memcpy(dst + 2 * r, blk, 2);   /* every type starts with the fp16 scale */
    if (type == GGML_TYPE_Q8_0) {
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++) dst[16 + 32 * j + 4 * r + e] = (uint8_t)(blk[2 + 4 * j + e] ^ 0x80);
        return;
    }
    /* block_q4_0: scale, 16 nibble bytes; block_q5_0: scale, 32 fifth bits, 16 nibble bytes */
    const uint8_t *nibbles = blk + (type == GGML_TYPE_Q5_0 ? 6 : 2);
    for (int j = 0; j < 4; j++) memcpy(dst + 16 + 32 * j + 4 * r, nibbles + 4 * j, 4);
    if (type != GGML_TYPE_Q5_0) return;
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    for (int t = 0; t < PP_PANEL_BLOCK; t++)
        if ((qh >> t) & 1) {
            const int i = 32 * (t / 4) + 4 * r + t % 4;
            dst[144 + i / 8] |= (uint8_t)(1u << (i % 8));
        }
}

/* Panels are streamed whole every step: in 2 MiB pages (where the kernel
 * gives them: transparent huge pages on request) a step takes far fewer TLB
 * misses, and the hardware prefetchers are not stopped at every 4 KiB page
 * end. Freed with free(). */
#define PP_PANEL_HUGE_PAGE ((size_t)2 << 20)
static uint8_t *panel_alloc(size_t size) {
    const size_t align = size >= PP_PANEL_HUGE_PAGE ? PP_PANEL_HUGE_PAGE : 64;
    const size_t rounded = (size + align - 1) / align * align;
    void *mem = NULL;
    if (posix_memalign(&mem, align, rounded) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    if (align == PP_PANEL_HUGE_PAGE) madvise(mem, rounded, MADV_HUGEPAGE);   /* a hint: no error to handle */
#endif
    return mem;
}

pp_q8_panels *pp_q8_panels_alloc(enum ggml_type type, int64_t k, int64_t n_rows) {
    if (!pp_q8_panels_fit(type, k, n_rows, PP_PANEL_KERNEL_SCALAR)) return NULL;
    pp_q8_panels *p = calloc(1, sizeof *p);
    const int64_t nb = k / PP_PANEL_BLOCK;
    const size_t size = pp_panel_type_is_k(type)
        ? (size_t)(n_rows / PP_PANEL_ROWS) * (size_t)(k / PP_PANEL_KBLOCK) * pp_kpanel_superblock_bytes(type)
        : pp_panel_type_is_float(type) ? (size_t)n_rows * (size_t)k * 2
        : (size_t)(n_rows / PP_PANEL_ROWS) * nb * panel_block_bytes(type);
    if (p) p->data = panel_alloc(size);
    if (!p || !p->data) {
        free(p);
        return NULL;
    }
    p->type = type;
    p->n_rows = n_rows;
    p->k = k;
    return p;
}

void pp_q8_panels_pack_range(pp_q8_panels *p, const void *data, int64_t p0, int64_t p1) {
    const enum ggml_type type = p->type;
    const int64_t k = p->k, nb = k / PP_PANEL_BLOCK;
    if (pp_panel_type_is_k(type)) {
        pp_kpanel_pack(data, type, k, p0, p1, p->data);
        return;
    }
    if (pp_panel_type_is_float(type)) {
        pp_fpanel_pack(data, k, p0, p1, p->data);
        return;
    }
    const size_t pbb = panel_block_bytes(type);
    /* Q5_0's fifth bits are ORed in; everything else is written whole */
    if (type == GGML_TYPE_Q5_0) memset(p->data + (size_t)p0 * nb * pbb, 0, (size_t)(p1 - p0) * nb * pbb);
    const uint8_t *src = data;
    const size_t row_bytes = (size_t)nb * ggml_type_size(type);
    for (int64_t pi = p0; pi < p1; pi++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = p->data + ((size_t)pi * nb + b) * pbb;
            for (int r = 0; r < PP_PANEL_ROWS; r++)
                pack_block_row(type, src + (size_t)(pi * PP_PANEL_ROWS + r) * row_bytes + (size_t)b * ggml_type_size(type),
                               r, dst);
        }
    }
}

pp_q8_panels *pp_q8_panels_pack(const void *data, enum ggml_type type, int64_t k, int64_t n_rows) {
    pp_q8_panels *p = pp_q8_panels_alloc(type, k, n_rows);
    if (p) pp_q8_panels_pack_range(p, data, 0, n_rows / PP_PANEL_ROWS);
    return p;
}

void pp_q8_panels_free(pp_q8_panels *p) {
    if (!p) return;
    free(p->data);
    free(p);
}

/* A Q5_0 or Q4_0 panel widened into the compute layout (portable). */
static void widen_scalar(enum ggml_type type, const uint8_t *panel, int64_t nb, uint8_t *out) {
    const size_t pbb = panel_block_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = panel + (size_t)b * pbb;
        uint8_t *dst = out + (size_t)b * PP_PANEL_BLOCK_BYTES;
        memcpy(dst, src, 16);
        for (int i = 0; i < 256; i++) {
            const int lo = i < 128 ? src[16 + i] & 0x0F : src[16 + i - 128] >> 4;
            if (type == GGML_TYPE_Q4_0) {
                dst[16 + i] = (uint8_t)(lo + 120);   /* q - 8 + 128 */
                continue;
            }
            const int hi = (src[144 + i / 8] >> (i % 8)) & 1;
            dst[16 + i] = (uint8_t)((lo | hi << 4) + 112);   /* q - 16 + 128 */
        }
    }
}

/* Panel pi in the compute layout: in place for Q8_0, else widened into tmp. */
static const uint8_t *compute_panel(const pp_q8_panels *w, int64_t pi, uint8_t *tmp) {
    const int64_t nb = w->k / PP_PANEL_BLOCK;
    if (w->type == GGML_TYPE_Q8_0) return w->data + (size_t)pi * nb * PP_PANEL_BLOCK_BYTES;
    widen_scalar(w->type, w->data + (size_t)pi * nb * panel_block_bytes(w->type), nb, tmp);
    return tmp;
}

void pp_q8_panels_row(const pp_q8_panels *p, int64_t row, float *out) {
    if (pp_panel_type_is_k(p->type)) {
        pp_kpanel_row(p, row, out);
        return;
    }
    if (pp_panel_type_is_float(p->type)) {
        pp_fpanel_row(p, row, out);
        return;
    }
    const int64_t nb = p->k / PP_PANEL_BLOCK;
    const int r = (int)(row % PP_PANEL_ROWS);
    uint8_t tmp[PP_PANEL_MAX_K / PP_PANEL_BLOCK * PP_PANEL_BLOCK_BYTES];
    const uint8_t *panel = compute_panel(p, row / PP_PANEL_ROWS, tmp);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel + (size_t)b * PP_PANEL_BLOCK_BYTES;
        ggml_fp16_t h;
        memcpy(&h, blk + 2 * r, 2);
        const float d = ggml_fp16_to_fp32(h);
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++)
                out[b * PP_PANEL_BLOCK + 4 * j + e] = d * (float)((int)blk[16 + 32 * j + 4 * r + e] - 128);
    }
}

/* Q8_0 quantization of one column as GGML's x86 code does it (scale amax /
 * 127 kept as fp16, values rounded to nearest even), plus each block's
 * sums (see pp_panel_column_bytes). */
void pp_panel_quantize_column(const float *x, int64_t k, uint8_t *col) {
    const int64_t nb = k / PP_PANEL_BLOCK;
    int8_t *q = (int8_t *)col;
    float *scale = (float *)(col + k);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * PP_PANEL_BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < PP_PANEL_BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        /* the reciprocal as GGML's x86 quantizer takes it, so the bytes match its */
        const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int32_t half[2] = {0, 0};
        for (int i = 0; i < PP_PANEL_BLOCK; i++) {
            const int v = (int)nearbyintf(xb[i] * id);
            q[b * PP_PANEL_BLOCK + i] = (int8_t)v;
            half[i / 16] += v;
        }
        scale[b] = ggml_fp16_to_fp32(ggml_fp32_to_fp16(d));
        pp_panel_column_sums(col, k, b, scale[b], half[0], half[1]);
    }
}

void pp_panel_column_sums(uint8_t *col, int64_t k, int64_t b, float scale, int32_t half0, int32_t half1) {
    const int64_t nb = k / PP_PANEL_BLOCK;
    const int32_t offset = -128 * (half0 + half1), off16[2] = {-32 * half0, -32 * half1};
    const float ssum = scale * (float)(half0 + half1);
    memcpy(col + k + 4 * nb + 4 * b, &offset, 4);
    memcpy(col + k + 8 * nb + 4 * b, &ssum, 4);
    memcpy(col + k + 12 * nb + 8 * b, off16, 8);
}

void pp_panel_gemm_scalar(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                          size_t col_stride, int64_t n, float *out, size_t ldo) {
    const int64_t k = w->k, nb = k / PP_PANEL_BLOCK;
    uint8_t tmp[PP_PANEL_MAX_K / PP_PANEL_BLOCK * PP_PANEL_BLOCK_BYTES];
    for (int64_t pi = p0; pi < p1; pi++) {
        const uint8_t *panel = compute_panel(w, pi, tmp);
        for (int64_t c = 0; c < n; c++) {
            const uint8_t *col = cols + (size_t)c * col_stride;
            const int8_t *q = (const int8_t *)col;
            const float *scale = (const float *)(col + k);
            const int32_t *offset = (const int32_t *)(col + k + 4 * nb);
            for (int r = 0; r < PP_PANEL_ROWS; r++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = panel + (size_t)b * PP_PANEL_BLOCK_BYTES;
                    int32_t dot = offset[b];
                    for (int j = 0; j < 8; j++)
                        for (int e = 0; e < 4; e++)
                            dot += (int32_t)blk[16 + 32 * j + 4 * r + e] * q[b * PP_PANEL_BLOCK + 4 * j + e];
                    ggml_fp16_t h;
                    memcpy(&h, blk + 2 * r, 2);
                    acc += (float)dot * (ggml_fp16_to_fp32(h) * scale[b]);
                }
                out[(size_t)c * ldo + (size_t)pi * PP_PANEL_ROWS + r] = acc;
            }
        }
    }
}

pp_panel_quantize_fn pp_panel_quantizer_for(enum pp_panel_kernel k) {
#if defined(__x86_64__)
    /* every CPU with a SIMD kernel has AVX2; the portable kernel keeps the portable quantizer */
    if (k == PP_PANEL_KERNEL_AVX512VNNI || k == PP_PANEL_KERNEL_AVXVNNI || k == PP_PANEL_KERNEL_AVX2)
        return pp_panel_quantize_column_avx2;
#endif
    return pp_panel_quantize_column;
}

/* Each thread quantizes every nth column. */
static void quantize_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *x = dst->src[0];
    const pp_panel_quantize_fn quantize = pp_panel_quantizer_for((enum pp_panel_kernel)(intptr_t)userdata);
    for (int64_t c = ith; c < x->ne[1]; c += nth)
        quantize((const float *)((const char *)x->data + c * x->nb[1]), x->ne[0], (uint8_t *)dst->data + c * dst->nb[1]);
}

/* Panels per chunk a thread takes at a time: about eight chunks per thread
 * (two threads end within a small chunk of each other), at most 256 rows
 * (the counter is touched a thousand times per 262k-row head, not per row). */
static int64_t chunk_panels(int64_t n_panels, int nth) {
    int64_t chunk = n_panels / (8 * (int64_t)nth);
    return chunk < 1 ? 1 : chunk > PP_PANEL_CHUNK ? PP_PANEL_CHUNK : chunk;
}

/* Chunks of panels, taken from the shared counter until none is left. */
static void gemm_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    pp_panel_gemm_state *st = userdata;
    const struct ggml_tensor *cols = dst->src[0];
    const pp_panel_kernel_fn fn = pp_panel_kernel_for(st->kernel, st->w->type);
    const int64_t n_panels = st->w->n_rows / PP_PANEL_ROWS, chunk = chunk_panels(n_panels, nth);
    for (;;) {
        const int64_t p0 = (int64_t)atomic_fetch_add(&st->next_chunk, 1) * chunk;
        if (p0 >= n_panels) break;
        const int64_t p1 = p0 + chunk < n_panels ? p0 + chunk : n_panels;
        fn(st->w, p0, p1, cols->data, cols->nb[1], cols->ne[1], dst->data, dst->nb[1] / sizeof(float));
    }
}

struct ggml_tensor *pp_panel_quantize(struct ggml_context *ctx, struct ggml_tensor *x,
                                      enum pp_panel_kernel kernel) {
    GGML_ASSERT(x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) && x->ne[2] == 1 && x->ne[3] == 1);
    return ggml_custom_4d(ctx, GGML_TYPE_I8, (int64_t)pp_panel_column_bytes(x->ne[0]), x->ne[1], 1, 1, &x, 1,
                          quantize_op, GGML_N_TASKS_MAX, (void *)(intptr_t)kernel);
}

struct ggml_tensor *pp_panel_gemm(struct ggml_context *ctx, pp_panel_gemm_state *state,
                                  struct ggml_tensor *cols) {
    if (pp_panel_type_is_float(state->w->type)) {
        GGML_ASSERT(cols->type == GGML_TYPE_F32 && cols->ne[0] == state->w->k && cols->nb[0] == sizeof(float) &&
                    cols->ne[2] == 1 && cols->ne[3] == 1);
    } else {
        GGML_ASSERT(cols->ne[0] == (int64_t)pp_panel_column_bytes(state->w->k));
    }
    /* Graphs are built before they run, one at a time per context: the
     * counter is free to rearm here. */
    atomic_store(&state->next_chunk, 0);
    return ggml_custom_4d(ctx, GGML_TYPE_F32, state->w->n_rows, cols->ne[1], 1, 1, &cols, 1, gemm_op,
                          GGML_N_TASKS_MAX, state);
}

static void embed_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const pp_q8_panels *w = userdata;
    const struct ggml_tensor *tokens = dst->src[0];
    for (int64_t t = ith; t < tokens->ne[0]; t += nth)
        pp_q8_panels_row(w, ((const int32_t *)tokens->data)[t], (float *)((char *)dst->data + t * dst->nb[1]));
}

struct ggml_tensor *pp_panel_embed(struct ggml_context *ctx, const pp_q8_panels *w,
                                   struct ggml_tensor *tokens) {
    /* token ids are checked against the vocabulary before any graph is built */
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->k, tokens->ne[0], 1, 1, &tokens, 1, embed_op,
                          GGML_N_TASKS_MAX, (void *)w);
}
