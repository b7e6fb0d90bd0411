/* Internal helpers shared by the native sources; not part of the contract. */
#ifndef PP_INTERNAL_H
#define PP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

/* Record a printf-style message as the calling thread's last error and
 * return status, so failures read as `return pp_fail(PP_ERR_..., ...)`. */
int32_t pp_fail(int32_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The borrowed bytes of a weight moved elsewhere (repacked, packed into
 * panels, offloaded to a device) are never read again: ask the kernel to
 * reclaim the whole pages inside them, keeping their contents. */
void pp_release_mapped(const void *data, size_t size);

/* Map from a 64-bit block hash to a physical block id (open addressing,
 * linear probing, backward-shift deletion so no tombstones accumulate). */
typedef struct pp_hash_map {
    uint64_t *keys;
    int32_t  *values;   /* -1 marks an empty slot */
    uint32_t  mask;     /* capacity - 1; capacity is a power of two */
    int32_t   count;
} pp_hash_map;

int     pp_hash_map_init(pp_hash_map *map, int32_t max_entries);
void    pp_hash_map_release(pp_hash_map *map);
int32_t pp_hash_map_get(const pp_hash_map *map, uint64_t key);   /* -1 if absent */
void    pp_hash_map_put(pp_hash_map *map, uint64_t key, int32_t value);
void    pp_hash_map_remove(pp_hash_map *map, uint64_t key);
void    pp_hash_map_clear(pp_hash_map *map);

#endif
