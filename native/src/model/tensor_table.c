/* Looking GGUF tensor names up in an architecture's tables, and checking
 * that a model has every tensor they require (tensor_table.h). */
#include "model/tensor_table.h"

#include <string.h>

static const pp_tensor_slot *find_slot(const pp_tensor_slot *table, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(name, table[i].name)) return &table[i];
    return NULL;
}

int32_t pp_tensor_layer(const char *name, int32_t n_layer, const char **suffix) {
    /* parsed by hand because sscanf's %d has undefined behaviour on overflow
     * (a fuzzed "blk.99999999999."): the layer stops growing at n_layer */
    if (strncmp(name, "blk.", 4) != 0) return -1;
    const char *p = name + 4;
    int64_t il = 0;
    if (*p < '0' || *p > '9') return -1;
    for (; *p >= '0' && *p <= '9'; p++) {
        il = il * 10 + (*p - '0');
        if (il >= n_layer) return -1;
    }
    if (*p != '.') return -1;
    *suffix = p + 1;
    return (int32_t)il;
}

int pp_resolve_tensor(pp_model *m, const pp_tensor_table *table, const char *name, pp_tensor_slot *spec) {
    pp_tensor_slot globals[PP_MAX_GLOBAL_SLOTS], layer[PP_MAX_LAYER_SLOTS];
    const pp_tensor_slot *found = find_slot(globals, table->globals(m, globals), name);
    const char *suffix = NULL;
    const int32_t il = found ? -1 : pp_tensor_layer(name, m->hp.n_layer, &suffix);
    if (il >= 0) found = find_slot(layer, table->layer(m, &m->layers[il], layer), suffix);
    if (!found) return 0;
    *spec = *found;
    return 1;
}

/* The first required slot of slots[0..n) still empty, or NULL. */
static const pp_tensor_slot *first_missing(const pp_tensor_slot *slots, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (slots[i].required && !*slots[i].slot) return &slots[i];
    return NULL;
}

int32_t pp_check_tensors(pp_model *m, const pp_tensor_table *table) {
    pp_tensor_slot globals[PP_MAX_GLOBAL_SLOTS], layer[PP_MAX_LAYER_SLOTS];
    const pp_tensor_slot *missing = first_missing(globals, table->globals(m, globals));
    if (missing) return pp_fail(PP_ERR_INVALID, "missing tensor '%s'", missing->name);
    for (int il = 0; il < m->hp.n_layer; il++) {
        missing = first_missing(layer, table->layer(m, &m->layers[il], layer));
        if (missing) return pp_fail(PP_ERR_INVALID, "missing tensor 'blk.%d.%s'", il, missing->name);
    }
    return PP_OK;
}
