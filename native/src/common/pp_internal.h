/* Internal helpers shared by the native sources; not part of the contract. */
#ifndef PP_INTERNAL_H
#define PP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

/* Record a printf-style message as the calling thread's last error and
 * return status, so failures read as `return pp_fail(PP_ERR_..., ...)`. */
int32_t pp_fail(int32_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* For a function more than one source calls that is no part of the library's
 * interface: kept out of the exported symbols. */
#define PP_HIDDEN __attribute__((visibility("hidden")))

#endif
