/* Vector math on f32 rows used by the paged-attention kernel (see
 * attention_math.c). Rows are head_dim (hd) floats, stored hd apart. The
 * functions come as tables, one per instruction-set variant, chosen at run
 * time by pp_attention_math_select. */
#ifndef PP_ATTENTION_MATH_H
#define PP_ATTENTION_MATH_H

#include "ggml.h"

typedef struct pp_attention_math {
    const char *name;   /* "avx2" or "generic" */

    /* One K or V row of a cache tensor (f16, q8_0 or any GGML type with a
     * to_float) to n floats. */
    void (*row_to_f32)(const struct ggml_tensor *cache, const void *src, float *restrict dst, int n);

    /* s[j] = q . k_j for j < n. */
    void (*dot_rows)(const float *restrict q, const float *restrict k, int n, int hd, float *restrict s);

    /* dot_rows for two query rows at once (each key row is read once). */
    void (*dot_rows2)(const float *restrict q0, const float *restrict q1, const float *restrict k, int n,
                      int hd, float *restrict s0, float *restrict s1);

    /* p[j] = e^(p[j] - m) in place for j < n (p[j] <= m); returns their sum. */
    float (*exp_shifted)(float *p, int n, float m);

    /* acc = acc * correction + sum_j p[j] v_j; keys with p[j] == 0 are skipped. */
    void (*accumulate_pv)(float *restrict acc, float correction, const float *restrict p,
                          const float *restrict v, int n, int hd);

    /* accumulate_pv for two rows sharing the same V rows. */
    void (*accumulate_pv2)(float *restrict acc0, float *restrict acc1, float c0, float c1,
                           const float *restrict p0, const float *restrict p1, const float *restrict v,
                           int n, int hd);
} pp_attention_math;

extern const pp_attention_math pp_attention_math_generic;
#ifdef PP_HAVE_AVX2_KERNELS
extern const pp_attention_math pp_attention_math_avx2;
#endif

/* The fastest table this CPU runs (AVX2 + FMA + F16C, else generic), unless
 * the environment variable PYLLAMA_PAGED_KERNELS=generic asks for the
 * portable one. Never NULL. */
const pp_attention_math *pp_attention_math_select(void);

#endif
