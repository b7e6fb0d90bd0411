/* A vision projector (an "mmproj" file's vision tower and projector) inside
 * the library: its hyper-parameters, weights (borrowed from the caller's
 * mapping, as pp_model's are) and compute context, shared by vision_model.c
 * (weights) and vision_encode.c (the graph and one image's encoding). */
#ifndef PP_VISION_INTERNAL_H
#define PP_VISION_INTERNAL_H

#include "pyllama_paged.h"
#include "common/cpu_compute.h"
#include "common/pp_internal.h"
#include "ggml.h"

typedef struct pp_vision_layer {
    struct ggml_tensor *ln1_w, *ln1_b, *ln2_w, *ln2_b;
    struct ggml_tensor *q_w, *q_b, *k_w, *k_b, *v_w, *v_b, *o_w, *o_b;
    struct ggml_tensor *up_w, *up_b, *down_w, *down_b;
} pp_vision_layer;

struct pp_vision {
    pp_vision_hparams   hp;
    struct ggml_context *weights;     /* tensor metadata; data borrowed */
    struct ggml_tensor  *patch_w, *patch_b, *pos, *post_w, *post_b, *soft_norm_w, *proj_w;
    pp_vision_layer     *layers;
    int                  finalized;
    pp_cpu_compute       compute;
};

/* Patches per side of the tower's grid, and image tokens per side after the pool. */
static inline int pp_vision_side(const pp_vision_hparams *hp) { return hp->image_size / hp->patch_size; }

/* Graph nodes the encoder's graph needs at most. */
static inline size_t pp_vision_graph_nodes(int n_layer) { return 128 + 48 * (size_t)n_layer; }

/* vision_encode.c: the tower and projector's graph. Input "patches"
 * [3 * p * p, n_patches] f32 (each patch flattened channel, row, column);
 * output "embeddings" [projection_dim, n_tokens]. */
PP_HIDDEN struct ggml_cgraph *pp_build_vision_graph(struct ggml_context *ctx, const pp_vision *v);

#endif
