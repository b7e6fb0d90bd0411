/* Per-thread last-error text behind pp_last_error(). */
#include "pyllama_paged.h"
#include "common/pp_internal.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[512];

int32_t pp_fail(int32_t status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, args);
    va_end(args);
    return status;
}

const char *pp_last_error(void) { return last_error; }

#ifndef PP_VERSION
#error "PP_VERSION must be defined by the build (CMakeLists.txt reads it from pyllama_paged/_version.py)"
#endif

const char *pp_version(void) { return PP_VERSION; }
