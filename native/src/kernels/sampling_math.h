/* Vector passes over a vocabulary-sized logits row for the batched sampler
 * (see sampling_math.c). Like the attention math, the functions come as
 * tables, one per instruction-set variant, chosen at run time. */
#ifndef PP_SAMPLING_MATH_H
#define PP_SAMPLING_MATH_H

#include <stdint.h>

/* Entries per block of pp_row_scan's partial sums and maxima. */
#define PP_SUM_BLOCK 256

/* What scan_row computes over a row x[0..n), n >= 1. */
typedef struct pp_row_scan {
    /* in */
    float    scale;        /* > 0: weigh every entry as e^((x[j] - max) * scale); 0: weigh nothing */
    float   *block_sums;   /* NULL, or room for ceil(n / PP_SUM_BLOCK) partial masses (with scale > 0) */
    float   *block_refs;   /* scratch of the same size, when block_sums is given */
    float   *block_maxes;  /* NULL, or room for each block's largest entry (-inf: none above -inf) */
    float   *weights;      /* NULL, or (with block_sums) room for n: every entry's weight */
    /* out */
    int32_t  best;         /* first index of the largest entry; NaN never wins, and a row with
                            * nothing above -inf gives an entry that is not above -inf either */
    double   mass;         /* the sum of the weights (scale > 0) */
} pp_row_scan;

typedef struct pp_sampling_math {
    const char *name;   /* "avx2" or "generic" */

    /* One read of the row (block by block: each block's second look is in
     * L1) finding what a draw needs; see pp_row_scan. */
    void (*scan_row)(const float *x, int32_t n, pp_row_scan *scan);

    /* The sum of the w[j] at least v (inclusive) or above v over w[0..n):
     * the mass of the tokens heavier than one token, from stored weights. */
    float (*mass_above)(const float *w, int32_t n, float v, int inclusive);

    /* The indices of x[j] >= cut in increasing order into ids (room for n);
     * returns how many. */
    int32_t (*select_at_least)(const float *x, int32_t n, float cut, int32_t *ids);
} pp_sampling_math;

extern const pp_sampling_math pp_sampling_math_generic;
#ifdef PP_HAVE_AVX2_KERNELS
extern const pp_sampling_math pp_sampling_math_avx2;
#endif

/* The table matching pp_attention_math_select's choice. Never NULL. */
const pp_sampling_math *pp_sampling_math_select(void);

#endif
