/* The panel GEMM's one dispatcher (panels.h): which kernel a CPU runs and
 * which kernel and quantizer go with a weight's format, the allocation of
 * every format's panels, packing and reading rows through the format's own
 * functions (panel_formats.h), and the graph ops around the kernels. The
 * formats never call back here. */
#include "panels/panel_formats.h"

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

/* Each weight family's kernel for each pp_panel_kernel (indexed by its value;
 * NULL where the family has no such kernel: its portable one runs). */
typedef pp_panel_kernel_fn family_kernels[PP_PANEL_KERNEL_AVX2 + 1];

#if defined(__x86_64__)
#define X86(fn) fn
#else
#define X86(fn) NULL
#endif
#define FAMILY(SCALAR, AVXVNNI, AVX512VNNI, AVX2)                                                        \
    {[PP_PANEL_KERNEL_SCALAR] = SCALAR, [PP_PANEL_KERNEL_AVXVNNI] = X86(AVXVNNI),                        \
     [PP_PANEL_KERNEL_AVX512VNNI] = X86(AVX512VNNI), [PP_PANEL_KERNEL_AVX2] = X86(AVX2)}
enum { FLOAT_PANELS, K_QUANT_PANELS, MXFP4_PANELS, Q8_PANELS };
static const family_kernels kernels_of[] = {
    [FLOAT_PANELS] = FAMILY(pp_fpanel_gemm_scalar, pp_fpanel_gemm_avx2, pp_fpanel_gemm_avx512vnni, pp_fpanel_gemm_avx2),
    [K_QUANT_PANELS] = FAMILY(pp_kpanel_gemm_scalar, pp_kpanel_gemm_avxvnni, pp_kpanel_gemm_avx512vnni, pp_kpanel_gemm_avx2),
    [MXFP4_PANELS] = FAMILY(pp_mxpanel_gemm_scalar, pp_mxpanel_gemm_avxvnni, pp_mxpanel_gemm_avx512vnni, pp_mxpanel_gemm_avx2),
    [Q8_PANELS] = FAMILY(pp_panel_gemm_scalar, pp_panel_gemm_avxvnni, pp_panel_gemm_avx512vnni, NULL),
};
#undef FAMILY
#undef X86

pp_panel_kernel_fn pp_panel_kernel_for(enum pp_panel_kernel k, enum ggml_type type) {
    const int is_float = pp_panel_type_is_float(type), is_k = pp_panel_type_is_k(type);
#if defined(__x86_64__)
    if (type == GGML_TYPE_BF16 && k == PP_PANEL_KERNEL_AVX512VNNI) return pp_fpanel_gemm_bf16_avx512vnni;
#endif
    const family_kernels *family = &kernels_of[is_float ? FLOAT_PANELS
                                               : is_k   ? K_QUANT_PANELS
                                               : type == GGML_TYPE_MXFP4 ? MXFP4_PANELS
                                                                         : Q8_PANELS];
    const pp_panel_kernel_fn fn = ((unsigned)k <= PP_PANEL_KERNEL_AVX2) ? (*family)[k] : NULL;
    return fn ? fn : (*family)[PP_PANEL_KERNEL_SCALAR];
}

int pp_q8_panels_fit(enum ggml_type type, int64_t k, int64_t n_rows, enum pp_panel_kernel kernel) {
    if (k <= 0 || n_rows <= 0 || k % PP_PANEL_BLOCK || n_rows % PP_PANEL_ROWS) return 0;
    if (pp_panel_type_is_k(type)) return k % PP_PANEL_KBLOCK == 0 && k <= PP_PANEL_K_MAX_K;
    if (pp_panel_type_is_float(type)) return 1;
    /* MXFP4's biased codes keep AVX2's pair sums small: every kernel takes it */
    if (type == GGML_TYPE_MXFP4) return k <= PP_PANEL_MAX_K;
    if (kernel == PP_PANEL_KERNEL_AVX2) return 0;
    return type == GGML_TYPE_Q8_0 || ((type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q4_0) && k <= PP_PANEL_MAX_K);
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

size_t pp_q8_panels_bytes(enum ggml_type type, int64_t k, int64_t n_rows) {
    if (!pp_q8_panels_fit(type, k, n_rows, PP_PANEL_KERNEL_SCALAR)) return 0;
    const int64_t nb = k / PP_PANEL_BLOCK;
    return pp_panel_type_is_k(type)
        ? (size_t)(n_rows / PP_PANEL_ROWS) * (size_t)(k / PP_PANEL_KBLOCK) * pp_kpanel_superblock_bytes(type)
        : pp_panel_type_is_float(type) ? (size_t)n_rows * (size_t)k * 2
        : type == GGML_TYPE_MXFP4 ? (size_t)(n_rows / PP_PANEL_ROWS) * nb * PP_PANEL_MX_BLOCK_BYTES
        : (size_t)(n_rows / PP_PANEL_ROWS) * nb * pp_q8panel_block_bytes(type);
}

pp_q8_panels *pp_q8_panels_alloc(enum ggml_type type, int64_t k, int64_t n_rows) {
    if (!pp_q8_panels_fit(type, k, n_rows, PP_PANEL_KERNEL_SCALAR)) return NULL;
    pp_q8_panels *p = calloc(1, sizeof *p);
    const size_t size = pp_q8_panels_bytes(type, k, n_rows);
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
    if (pp_panel_type_is_k(p->type)) pp_kpanel_pack(data, p->type, p->k, p0, p1, p->data);
    else if (pp_panel_type_is_float(p->type)) pp_fpanel_pack(data, p->k, p0, p1, p->data);
    else if (p->type == GGML_TYPE_MXFP4) pp_mxpanel_pack(data, p->k, p0, p1, p->data);
    else pp_q8panel_pack(data, p->type, p->k, p0, p1, p->data);
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

/* One allocation for all of a layer's experts: a 30B-A3B layer's gate is 128
 * experts of 0.8 MiB, in 2 MiB pages only as one block. Each expert starts
 * on a cache line. */
pp_expert_panels *pp_expert_panels_alloc(enum ggml_type type, int64_t k, int64_t n_rows, int64_t n_expert) {
    const size_t bytes = pp_q8_panels_bytes(type, k, n_rows);
    if (bytes == 0 || n_expert <= 0) return NULL;
    const size_t stride = (bytes + 63) / 64 * 64;
    pp_expert_panels *ep = calloc(1, sizeof *ep);
    if (!ep) return NULL;
    ep->experts = calloc((size_t)n_expert, sizeof *ep->experts);
    ep->data = ep->experts ? panel_alloc(stride * (size_t)n_expert) : NULL;
    if (!ep->data) {
        pp_expert_panels_free(ep);
        return NULL;
    }
    ep->n_expert = n_expert;
    ep->panel_bytes = pp_q8_panels_bytes(type, k, PP_PANEL_ROWS);
    for (int64_t e = 0; e < n_expert; e++)
        ep->experts[e] = (pp_q8_panels){.type = type, .n_rows = n_rows, .k = k, .data = ep->data + (size_t)e * stride};
    return ep;
}

void pp_expert_panels_free(pp_expert_panels *ep) {
    if (!ep) return;
    free(ep->data);
    free(ep->experts);
    free(ep);
}

void pp_q8_panels_row(const pp_q8_panels *p, int64_t row, float *out) {
    if (pp_panel_type_is_k(p->type)) pp_kpanel_row(p, row, out);
    else if (pp_panel_type_is_float(p->type)) pp_fpanel_row(p, row, out);
    else if (p->type == GGML_TYPE_MXFP4) pp_mxpanel_row(p, row, out);
    else pp_q8panel_row(p, row, out);
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

static uint64_t pack_range(uint64_t lo, uint64_t hi) {
    return lo | hi << 32;
}

/* Up to chunk panels from range r: the front for its owner, the back for others. */
static int claim(pp_panel_range *r, int owner, int64_t chunk, int64_t *p0, int64_t *p1) {
    uint64_t cur = atomic_load_explicit(&r->lo_hi, memory_order_relaxed);
    for (;;) {
        const int64_t lo = (int64_t)(cur & 0xffffffffu), hi = (int64_t)(cur >> 32);
        if (lo >= hi) return 0;
        const int64_t n = hi - lo < chunk ? hi - lo : chunk;
        const uint64_t next = owner ? pack_range((uint64_t)(lo + n), (uint64_t)hi) : pack_range((uint64_t)lo, (uint64_t)(hi - n));
        if (atomic_compare_exchange_weak_explicit(&r->lo_hi, &cur, next, memory_order_relaxed, memory_order_relaxed)) {
            *p0 = owner ? lo : hi - n;
            *p1 = owner ? lo + n : hi;
            return 1;
        }
    }
}

int pp_panel_next_chunk(pp_panel_gemm_state *st, int ith, int nth, int64_t n_panels, int64_t chunk, int *cursor,
                        int64_t *p0, int64_t *p1) {
    if (st->n_ranges != nth) {   /* cut for another thread count: chunks in turn */
        *p0 = (int64_t)atomic_fetch_add(&st->next_chunk, 1) * chunk;
        if (*p0 >= n_panels) return 0;
        *p1 = *p0 + chunk < n_panels ? *p0 + chunk : n_panels;
        return 1;
    }
    for (; *cursor < nth; ++*cursor)
        if (claim(&st->ranges[(ith + *cursor) % nth], *cursor == 0, chunk, p0, p1)) return 1;
    return 0;
}

/* Chunks of panels, this thread's range first, until none is left. */
static void gemm_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    pp_panel_gemm_state *st = userdata;
    const struct ggml_tensor *cols = dst->src[0];
    const pp_panel_kernel_fn fn = pp_panel_kernel_for(st->kernel, st->w->type);
    const int64_t n_panels = st->w->n_rows / PP_PANEL_ROWS, chunk = chunk_panels(n_panels, nth);
    int cursor = 0;
    int64_t p0, p1;
    while (pp_panel_next_chunk(st, ith, nth, n_panels, chunk, &cursor, &p0, &p1))
        fn(st->w, p0, p1, cols->data, cols->nb[1], cols->ne[1], dst->data, dst->nb[1] / sizeof(float));
}

struct ggml_tensor *pp_panel_quantize(struct ggml_context *ctx, struct ggml_tensor *x,
                                      enum pp_panel_kernel kernel) {
    GGML_ASSERT(x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) && x->ne[2] == 1 && x->ne[3] == 1);
    return ggml_custom_4d(ctx, GGML_TYPE_I8, (int64_t)pp_panel_column_bytes(x->ne[0]), x->ne[1], 1, 1, &x, 1,
                          quantize_op, GGML_N_TASKS_MAX, (void *)(intptr_t)kernel);
}

void pp_panel_gemm_rearm(pp_panel_gemm_state *states, int n, int n_threads) {
    for (int i = 0; i < n; i++) {
        pp_panel_gemm_state *st = &states[i];
        atomic_store(&st->next_chunk, 0);
        st->n_ranges = st->w && n_threads <= PP_PANEL_MAX_RANGES ? n_threads : 0;
        const int64_t n_panels = st->w ? st->w->n_rows / PP_PANEL_ROWS : 0;
        for (int t = 0; t < st->n_ranges; t++)
            atomic_store_explicit(&st->ranges[t].lo_hi,
                                  pack_range((uint64_t)(n_panels * t / n_threads), (uint64_t)(n_panels * (t + 1) / n_threads)),
                                  memory_order_relaxed);
    }
}

struct ggml_tensor *pp_panel_gemm(struct ggml_context *ctx, pp_panel_gemm_state *state,
                                  struct ggml_tensor *cols) {
    if (pp_panel_type_is_float(state->w->type)) {
        GGML_ASSERT(cols->type == GGML_TYPE_F32 && cols->ne[0] == state->w->k && cols->nb[0] == sizeof(float) &&
                    cols->ne[2] == 1 && cols->ne[3] == 1);
    } else {
        GGML_ASSERT(cols->ne[0] == (int64_t)pp_panel_column_bytes(state->w->k));
    }
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
