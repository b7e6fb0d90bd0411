/* GGML's log output, filtered by level. GGML's default logger prints every
 * message, including per-tensor debug lines (e.g. one per repacked weight),
 * to stderr; a library must not write those into its users' terminals. */
#include "pyllama_paged.h"
#include "ggml.h"

#include <stdatomic.h>
#include <stdio.h>

static atomic_int min_level = GGML_LOG_LEVEL_WARN;
static _Thread_local int last_level = GGML_LOG_LEVEL_NONE;  /* for GGML_LOG_LEVEL_CONT lines */

static void filtered_log(enum ggml_log_level level, const char *text, void *user_data) {
    (void)user_data;
    if (level == GGML_LOG_LEVEL_CONT) level = last_level;
    else last_level = level;
    if ((int)level >= atomic_load(&min_level)) {
        fputs(text, stderr);
        fflush(stderr);
    }
}

void pp_set_ggml_log_level(int32_t level) {
    atomic_store(&min_level, level);
    ggml_log_set(filtered_log, NULL);
}
