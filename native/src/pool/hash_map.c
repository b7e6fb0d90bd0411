/* Block-hash -> block-id map used by the prefix cache. */
#include "pyllama_paged.h"
#include "pool/hash_map.h"

#include <stdlib.h>
#include <string.h>

static uint32_t slot_of(uint64_t key, uint32_t mask) {
    /* The keys are already well-mixed hashes; fold the high bits in anyway
     * so a weak caller-supplied hash still spreads. */
    return (uint32_t)(key ^ (key >> 32)) & mask;
}

int32_t pp_hash_map_init(pp_hash_map *map, int32_t max_entries) {
    uint32_t capacity = 16;
    /* Load factor at most 1/2 keeps probe chains short. */
    while (capacity < (uint32_t)max_entries * 2u) capacity <<= 1;
    map->keys = malloc(sizeof(uint64_t) * capacity);
    map->values = malloc(sizeof(int32_t) * capacity);
    if (!map->keys || !map->values) {
        free(map->keys);
        free(map->values);
        map->keys = NULL;
        map->values = NULL;
        return PP_ERR_NO_MEMORY;
    }
    map->mask = capacity - 1;
    pp_hash_map_clear(map);
    return PP_OK;
}

void pp_hash_map_release(pp_hash_map *map) {
    free(map->keys);
    free(map->values);
    map->keys = NULL;
    map->values = NULL;
}

void pp_hash_map_clear(pp_hash_map *map) {
    memset(map->values, 0xff, sizeof(int32_t) * (map->mask + 1));
    map->count = 0;
}

int32_t pp_hash_map_get(const pp_hash_map *map, uint64_t key) {
    for (uint32_t i = slot_of(key, map->mask);; i = (i + 1) & map->mask) {
        if (map->values[i] < 0) return -1;
        if (map->keys[i] == key) return map->values[i];
    }
}

void pp_hash_map_put(pp_hash_map *map, uint64_t key, int32_t value) {
    for (uint32_t i = slot_of(key, map->mask);; i = (i + 1) & map->mask) {
        if (map->values[i] < 0) {
            map->keys[i] = key;
            map->values[i] = value;
            map->count++;
            return;
        }
        if (map->keys[i] == key) {
            map->values[i] = value;
            return;
        }
    }
}

void pp_hash_map_remove(pp_hash_map *map, uint64_t key) {
    uint32_t i = slot_of(key, map->mask);
    while (map->values[i] >= 0 && map->keys[i] != key) i = (i + 1) & map->mask;
    if (map->values[i] < 0) return;
    map->values[i] = -1;
    map->count--;
    /* Backward-shift: pull later members of the probe run into the hole
     * when their home slot does not lie strictly between hole and them. */
    for (uint32_t j = (i + 1) & map->mask; map->values[j] >= 0; j = (j + 1) & map->mask) {
        uint32_t home = slot_of(map->keys[j], map->mask);
        int movable = (i <= j) ? (home <= i || home > j) : (home <= i && home > j);
        if (movable) {
            map->keys[i] = map->keys[j];
            map->values[i] = map->values[j];
            map->values[j] = -1;
            i = j;
        }
    }
}
