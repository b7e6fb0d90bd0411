/* Map from a 64-bit block hash to a physical block id, the prefix cache's
 * index (open addressing, linear probing, backward-shift deletion so no
 * tombstones accumulate). */
#ifndef PP_HASH_MAP_H
#define PP_HASH_MAP_H

#include <stdint.h>

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
