/* One image through the vision tower and projector: the graph (patch
 * embedding as a matrix product over patches the upload flattens, position
 * embeddings, pre-norm ViT blocks, the post-layernorm, Gemma 3's pool, norm
 * and projection) and its computation on the encoder's CPU backend. */
#include "vision/vision_internal.h"

#include <math.h>
#include <string.h>

static struct ggml_tensor *layer_norm(struct ggml_context *ctx, struct ggml_tensor *x, struct ggml_tensor *w,
                                      struct ggml_tensor *b, float eps) {
    return ggml_add(ctx, ggml_mul(ctx, ggml_norm(ctx, x, eps), w), b);
}

static struct ggml_tensor *linear(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *b,
                                  struct ggml_tensor *x) {
    return ggml_add(ctx, ggml_mul_mat(ctx, w, x), b);
}

/* Every patch attends to every patch. x: [n_embd, n]; returns [n_embd, n] before attn_out. */
static struct ggml_tensor *attention(struct ggml_context *ctx, const pp_vision_hparams *hp, const pp_vision_layer *L,
                                     struct ggml_tensor *x) {
    const int64_t n = x->ne[1], nh = hp->n_head, hd = hp->n_embd / hp->n_head;
    struct ggml_tensor *q = ggml_reshape_3d(ctx, linear(ctx, L->q_w, L->q_b, x), hd, nh, n);
    struct ggml_tensor *k = ggml_reshape_3d(ctx, linear(ctx, L->k_w, L->k_b, x), hd, nh, n);
    struct ggml_tensor *v = ggml_reshape_3d(ctx, linear(ctx, L->v_w, L->v_b, x), hd, nh, n);
    q = ggml_permute(ctx, q, 0, 2, 1, 3);                                /* [hd, n, nh] */
    k = ggml_permute(ctx, k, 0, 2, 1, 3);
    v = ggml_permute(ctx, v, 0, 2, 1, 3);
    /* GGML's flash attention: a 896-pixel image's 4096 patches never hold their n x n scores
     * (1 GiB for 16 heads); its result is [hd, nh, n_q] */
    struct ggml_tensor *out = ggml_flash_attn_ext(ctx, q, k, v, NULL, 1.0f / sqrtf((float)hd), 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    return ggml_reshape_2d(ctx, out, hp->n_embd, n);
}

/* Gemma 3: the grid averaged over scale_factor^2 squares, RMS-normed, projected to the text width. */
static struct ggml_tensor *gemma3_projector(struct ggml_context *ctx, const pp_vision *v, struct ggml_tensor *x) {
    const pp_vision_hparams *hp = &v->hp;
    const int side = pp_vision_side(hp), k = hp->scale_factor, out_side = side / k;
    struct ggml_tensor *grid = ggml_cont(ctx, ggml_transpose(ctx, x));  /* [n_patches, n_embd] */
    grid = ggml_reshape_3d(ctx, grid, side, side, hp->n_embd);          /* column, row, channel */
    grid = ggml_pool_2d(ctx, grid, GGML_OP_POOL_AVG, k, k, k, k, 0, 0);
    x = ggml_reshape_2d(ctx, grid, (int64_t)out_side * out_side, hp->n_embd);
    x = ggml_cont(ctx, ggml_transpose(ctx, x));                         /* [n_embd, n_tokens] */
    x = ggml_mul(ctx, ggml_rms_norm(ctx, x, hp->eps), v->soft_norm_w);
    /* the file stores the projection [projection_dim, n_embd]; products take [n_embd, projection_dim] */
    return ggml_mul_mat(ctx, ggml_cont(ctx, ggml_transpose(ctx, v->proj_w)), x);
}

struct ggml_cgraph *pp_build_vision_graph(struct ggml_context *ctx, const pp_vision *v) {
    const pp_vision_hparams *hp = &v->hp;
    const int64_t p = hp->patch_size, n = (int64_t)pp_vision_side(hp) * pp_vision_side(hp);
    struct ggml_cgraph *gf = ggml_new_graph_custom(ctx, pp_vision_graph_nodes(hp->n_layer), false);
    struct ggml_tensor *patches = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 3 * p * p, n);
    ggml_set_name(patches, "patches");
    ggml_set_input(patches);
    /* the convolution kernel [p, p, 3, n_embd] is, row by row, a [3 * p * p, n_embd] matrix */
    struct ggml_tensor *kernel = ggml_reshape_2d(ctx, v->patch_w, 3 * p * p, hp->n_embd);
    struct ggml_tensor *x = ggml_add(ctx, linear(ctx, kernel, v->patch_b, patches), v->pos);
    for (int il = 0; il < hp->n_layer; il++) {
        const pp_vision_layer *L = &v->layers[il];
        struct ggml_tensor *cur = attention(ctx, hp, L, layer_norm(ctx, x, L->ln1_w, L->ln1_b, hp->eps));
        x = ggml_add(ctx, x, linear(ctx, L->o_w, L->o_b, cur));
        cur = ggml_gelu(ctx, linear(ctx, L->up_w, L->up_b, layer_norm(ctx, x, L->ln2_w, L->ln2_b, hp->eps)));
        x = ggml_add(ctx, x, linear(ctx, L->down_w, L->down_b, cur));
    }
    x = layer_norm(ctx, x, v->post_w, v->post_b, hp->eps);
    x = gemma3_projector(ctx, v, x);
    ggml_set_name(x, "embeddings");
    ggml_set_output(x);
    ggml_build_forward_expand(gf, x);
    return gf;
}

/* Planar pixels [3][size][size] into patch rows: patch (py, px) at row py * side + px, its
 * values in (channel, row, column) order, the convolution kernel's order. */
static void upload_patches(float *dst, const float *pixels, int size, int p) {
    const int side = size / p;
    for (int py = 0; py < side; py++)
        for (int px = 0; px < side; px++)
            for (int c = 0; c < 3; c++)
                for (int ky = 0; ky < p; ky++) {
                    const float *src = pixels + ((size_t)c * size + (size_t)py * p + ky) * size + (size_t)px * p;
                    memcpy(dst, src, sizeof(float) * (size_t)p);
                    dst += p;
                }
}

int32_t pp_vision_encode(pp_vision *v, const float *pixels, float *out) {
    if (!v || !pixels || !out) return pp_fail(PP_ERR_INVALID, "pp_vision_encode: NULL argument");
    if (!v->finalized) return pp_fail(PP_ERR_INVALID, "the vision encoder is not finalized (missing tensors?)");
    struct ggml_context *ctx = pp_cpu_compute_begin(&v->compute);
    if (!ctx) return PP_ERR_NO_MEMORY;
    struct ggml_cgraph *gf = pp_build_vision_graph(ctx, v);
    int32_t st = pp_cpu_compute_alloc(&v->compute, gf, "an image");
    if (st == PP_OK) {
        upload_patches(ggml_graph_get_tensor(gf, "patches")->data, pixels, v->hp.image_size, v->hp.patch_size);
        st = pp_cpu_compute_run(&v->compute, gf, "vision encoder");
    }
    if (st != PP_OK) {
        ggml_free(ctx);
        return st;
    }
    const struct ggml_tensor *emb = ggml_graph_get_tensor(gf, "embeddings");
    memcpy(out, emb->data, ggml_nbytes(emb));
    ggml_free(ctx);
    return PP_OK;
}
