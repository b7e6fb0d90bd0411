/* A model's tensors by GGUF name, in the one form every architecture
 * describes them: tables of where each tensor goes in pp_model, the shape
 * the hyper-parameters give it and whether the model needs it. The
 * decoders' tables are in model.c, bert's in encoder_model.c; looking a
 * name up and checking that a model is complete (tensor_table.c) work on
 * any such table, so neither architecture's file calls the other's. */
#ifndef PP_TENSOR_TABLE_H
#define PP_TENSOR_TABLE_H

#include "common/engine_internal.h"
#include "common/pp_internal.h"

/* A GGUF tensor name, where the tensor goes in pp_model, the shape it must
 * have (ne1 = 0: 1-D; ne2 = 0: at most 2-D, else 3-D, one matrix per expert),
 * whether finalizing fails without it, and whether it must be f32 though 2-D
 * (1-D tensors always must). */
typedef struct pp_tensor_slot {
    const char *name;
    struct ggml_tensor **slot;
    int64_t ne0, ne1;
    int required;
    int64_t ne2;
    int f32;
} pp_tensor_slot;

/* The most tensors outside the layers, and in one layer, of any table. */
#define PP_MAX_GLOBAL_SLOTS 8
#define PP_MAX_LAYER_SLOTS 32

/* A globals table's end: table (an array in scope) copied to out, its count returned. */
#define PP_RETURN_GLOBAL_SLOTS(table)                                                                   \
    do {                                                                                                \
        _Static_assert(sizeof(table) <= PP_MAX_GLOBAL_SLOTS * sizeof(table)[0], "raise PP_MAX_GLOBAL_SLOTS"); \
        memcpy(out, (table), sizeof(table));                                                            \
        return sizeof(table) / sizeof(table)[0];                                                        \
    } while (0)

/* An architecture's tables: each writes its slots to out (room for
 * PP_MAX_GLOBAL_SLOTS or PP_MAX_LAYER_SLOTS) and returns how many it wrote;
 * a layer's are keyed by the name's suffix after "blk.<il>.". */
typedef struct pp_tensor_table {
    size_t (*globals)(pp_model *m, pp_tensor_slot *out);
    size_t (*layer)(const pp_model *m, pp_layer *L, pp_tensor_slot *out);
} pp_tensor_table;

/* The layer of a "blk.<decimal layer>.<suffix>" name, with *suffix pointing
 * into name; -1 for any other name or a layer >= n_layer. */
PP_HIDDEN int32_t pp_tensor_layer(const char *name, int32_t n_layer, const char **suffix);

/* Where name goes (1, with *spec) or 0 for a name the model does not use:
 * an entry of the globals, or for "blk.<il>.<suffix>" with il < n_layer the
 * entry of layer il's table named suffix. */
int pp_resolve_tensor(pp_model *m, const pp_tensor_table *table, const char *name, pp_tensor_slot *spec);

/* PP_OK, or PP_ERR_INVALID naming the first required tensor missing (the
 * globals first, then layer by layer, in table order). */
PP_HIDDEN int32_t pp_check_tensors(pp_model *m, const pp_tensor_table *table);

/* encoder_model.c: where a bert tensor name goes (as pp_resolve_tensor), and
 * the check that bert's hyper-parameters fit and every tensor it needs is
 * there. Call only for PP_ARCH_BERT models. */
int pp_encoder_resolve(pp_model *m, const char *name, pp_tensor_slot *spec);
int32_t pp_encoder_finalize(pp_model *m);

/* gemma4_model.c: Gemma 4's tensor table; the check that a model's per-layer
 * shapes (pp_model_hparams' layer_* arrays, where given) fit and that each
 * shared-KV layer reads an earlier layer of its window and shapes with KV of
 * its own (PP_ERR_INVALID naming the layer); and the check that a gemma4
 * model has every tensor it needs, an expert layer its gate and up in one of
 * the two forms. */
extern const pp_tensor_table pp_gemma4_tensors;
int32_t pp_check_layer_shapes(const pp_model_hparams *hp);
int32_t pp_gemma4_finalize(pp_model *m);

#endif
