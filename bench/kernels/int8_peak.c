/* The int8 compute ceiling of the roofline (bench/roofline.py): multiply-
 * accumulates per second of this CPU's widest int8 dot-product instruction,
 * on T threads, each running independent accumulator chains in registers
 * (enough of them to cover the instruction's latency), nothing from memory.
 *
 *     cc -O2 -march=native -pthread bench/int8_peak.c -o int8_peak
 *     ./int8_peak THREADS          -> "<isa> <MACs per second>"
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CHAINS 12
#define ITERATIONS 20000000L

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ISA "avx512-vnni (zmm vpdpbusd)"
#define MACS_PER_OP 64
typedef __m512i vec;
static inline vec op(vec acc, vec a, vec b) { return _mm512_dpbusd_epi32(acc, a, b); }
static inline vec splat(int x) { return _mm512_set1_epi32(x); }
static inline int lane0(vec v) { return _mm_cvtsi128_si32(_mm512_castsi512_si128(v)); }
#elif defined(__AVXVNNI__) || defined(__AVX2__)
#define MACS_PER_OP 32
typedef __m256i vec;
static inline vec splat(int x) { return _mm256_set1_epi32(x); }
static inline int lane0(vec v) { return _mm_cvtsi128_si32(_mm256_castsi256_si128(v)); }
#if defined(__AVXVNNI__)
#define ISA "avx-vnni (ymm vpdpbusd)"
static inline vec op(vec acc, vec a, vec b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
#else
/* maddubs + madd + add: the three instructions our AVX2 kernel spends on 32 MACs */
#define ISA "avx2 (ymm maddubs + madd)"
static inline vec op(vec acc, vec a, vec b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
#endif
#else
#error "int8_peak needs AVX2 at least"
#endif

static void *run(void *arg) {
    const int seed = (int)(intptr_t)arg;
    vec acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) acc[c] = splat(seed + c);
    const vec a = splat(0x01020304 + seed), b = splat(0x05060708);
    for (long i = 0; i < ITERATIONS; i++)
        for (int c = 0; c < CHAINS; c++) acc[c] = op(acc[c], a, b);
    int sum = 0;
    for (int c = 0; c < CHAINS; c++) sum += lane0(acc[c]);
    return (void *)(intptr_t)sum;   /* the result is used: the loop cannot be dropped */
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 1;
    if (threads < 1 || threads > 1024) {
        fprintf(stderr, "usage: %s THREADS (1..1024)\n", argv[0]);
        return 2;
    }
    pthread_t *tid = calloc((size_t)threads, sizeof *tid);
    if (!tid) return 1;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int t = 0; t < threads; t++)
        if (pthread_create(&tid[t], NULL, run, (void *)(intptr_t)t) != 0) return 1;
    long check = 0;
    for (int t = 0; t < threads; t++) {
        void *r;
        pthread_join(tid[t], &r);
        check += (intptr_t)r;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    const double macs = (double)threads * ITERATIONS * CHAINS * MACS_PER_OP;
    printf("%s %.6g %ld\n", ISA, macs / s, check & 1);
    free(tid);
    return 0;
}
