/* Run-time choice of the vector math variants (attention and sampling): the
 * library is built for the x86-64 baseline, with AVX2 variants used only
 * where the CPU has them. */
#include "kernels/attention_math.h"
#include "kernels/sampling_math.h"

#include <stdlib.h>
#include <string.h>

const pp_attention_math *pp_attention_math_select(void) {
    const char *forced = getenv("PYLLAMA_PAGED_KERNELS");
    if (forced && strcmp(forced, "generic") == 0) return &pp_attention_math_generic;
#ifdef PP_HAVE_AVX2_KERNELS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return &pp_attention_math_avx2;
#endif
    return &pp_attention_math_generic;
}

const pp_sampling_math *pp_sampling_math_select(void) {
#ifdef PP_HAVE_AVX2_KERNELS
    if (pp_attention_math_select() == &pp_attention_math_avx2) return &pp_sampling_math_avx2;
#endif
    return &pp_sampling_math_generic;
}
