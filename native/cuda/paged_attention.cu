/* Paged attention for decode on CUDA: one query row per sequence (per query
 * head), K and V read page by page through the sequence's block table.
 *
 * Pages are our KV pools' layout: token rows of all KV heads, f16, slot =
 * block_id * block_size + offset. A CTA handles one (partition of the key
 * range, KV head, sequence) and all the query heads of that KV head's GQA
 * group, so each key row is read from memory once for the whole group. Its
 * warps take keys round-robin; the 32 lanes split the head dimension (8
 * halves each for head_dim 256), so a key row is one coalesced read. Scores
 * are reduced across lanes with shuffles and folded into an online softmax
 * per warp; the warps merge in shared memory, and partitions (split-K, for
 * long contexts with few sequences) are merged by a second kernel with a
 * log-sum-exp. The window (sliding-window layers) limits the key range.
 *
 * Status: compiled here (nvcc), checked against a NumPy reference by
 * tests/native/test_cuda_attention.py on a machine with a GPU (skipped without
 * one). Not yet wired into the engine: that needs GGML built with CUDA. */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define PP_WARPS 4
#define PP_MAX_GROUP 8

namespace {

template <int HD>
struct lane_slice {
    static constexpr int n = HD / 32;   /* elements of a row each lane holds */
};

/* The lane's n halves of a row, as floats. */
template <int N>
__device__ inline void load_row(const __half *row, int lane, float *out) {
    const __half *p = row + lane * N;
#pragma unroll
    for (int i = 0; i < N; i += 2) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(p + i));
        out[i] = f.x;
        out[i + 1] = f.y;
    }
}

__device__ inline float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

struct decode_args {
    const float   *q;             /* [n_seqs][n_head][HD], scaled by the caller's scale here */
    const __half  *k_pool;        /* [num_slots][n_head_kv][HD] */
    const __half  *v_pool;
    const int32_t *block_tables;  /* [n_seqs][max_blocks] */
    const int32_t *seq_lens;      /* keys of each sequence (its query sits at seq_len - 1) */
    float         *partial;       /* [n_seqs][n_head][n_parts][HD + 2]: acc, max, sum */
    int n_head, n_head_kv, block_size, max_blocks, window, part_keys, n_parts;
    float scale;
};

/* One (partition, KV head, sequence): fold the partition's keys for every
 * query head of the group into (acc, max, sum). */
template <int HD>
__global__ void __launch_bounds__(PP_WARPS * 32) paged_decode_partial(decode_args a) {
    constexpr int N = lane_slice<HD>::n;
    const int part = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = a.n_head / a.n_head_kv;
    const int len = a.seq_lens[s];
    const int first = a.window > 0 && len - a.window > 0 ? len - a.window : 0;
    const int k_begin = first + part * a.part_keys;
    const int k_end = min(len, k_begin + a.part_keys);

    float q[PP_MAX_GROUP][N];
    float m[PP_MAX_GROUP], l[PP_MAX_GROUP], acc[PP_MAX_GROUP][N];
    for (int g = 0; g < group; g++) {
        const float *qrow = a.q + ((size_t)s * a.n_head + kvh * group + g) * HD + lane * N;
#pragma unroll
        for (int i = 0; i < N; i++) {
            q[g][i] = qrow[i] * a.scale;
            acc[g][i] = 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const int32_t *table = a.block_tables + (size_t)s * a.max_blocks;
    const size_t row_stride = (size_t)a.n_head_kv * HD;
    for (int k = k_begin + warp; k < k_end; k += PP_WARPS) {
        const int64_t slot = (int64_t)table[k / a.block_size] * a.block_size + k % a.block_size;
        float kr[N], vr[N];
        load_row<N>(a.k_pool + slot * row_stride + (size_t)kvh * HD, lane, kr);
        load_row<N>(a.v_pool + slot * row_stride + (size_t)kvh * HD, lane, vr);
        for (int g = 0; g < group; g++) {
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < N; i++) dot += q[g][i] * kr[i];
            const float score = warp_sum(dot);
            const float m_new = fmaxf(m[g], score);
            const float correction = __expf(m[g] - m_new);
            const float p = __expf(score - m_new);
            l[g] = l[g] * correction + p;
#pragma unroll
            for (int i = 0; i < N; i++) acc[g][i] = acc[g][i] * correction + p * vr[i];
            m[g] = m_new;
        }
    }
    /* Merge the warps: each writes its state, warp 0 folds them. */
    __shared__ float sh_m[PP_WARPS][PP_MAX_GROUP], sh_l[PP_WARPS][PP_MAX_GROUP];
    __shared__ float sh_acc[PP_WARPS][PP_MAX_GROUP][HD];
    for (int g = 0; g < group; g++) {
        if (lane == 0) {
            sh_m[warp][g] = m[g];
            sh_l[warp][g] = l[g];
        }
#pragma unroll
        for (int i = 0; i < N; i++) sh_acc[warp][g][lane * N + i] = acc[g][i];
    }
    __syncthreads();
    if (warp != 0) return;
    for (int g = 0; g < group; g++) {
        float mx = -INFINITY;
        for (int w = 0; w < PP_WARPS; w++) mx = fmaxf(mx, sh_m[w][g]);
        float sum = 0.0f, out[N];
#pragma unroll
        for (int i = 0; i < N; i++) out[i] = 0.0f;
        for (int w = 0; w < PP_WARPS; w++) {
            if (sh_l[w][g] == 0.0f) continue;   /* a warp that saw no key */
            const float c = __expf(sh_m[w][g] - mx);
            sum += sh_l[w][g] * c;
#pragma unroll
            for (int i = 0; i < N; i++) out[i] += sh_acc[w][g][lane * N + i] * c;
        }
        float *dst = a.partial + (((size_t)s * a.n_head + kvh * group + g) * a.n_parts + part) * (HD + 2);
#pragma unroll
        for (int i = 0; i < N; i++) dst[lane * N + i] = out[i];
        if (lane == 0) {
            dst[HD] = mx;
            dst[HD + 1] = sum;
        }
    }
}

/* Merge the partitions of each (sequence, query head) into out [n_seqs][n_head][HD]. */
template <int HD>
__global__ void paged_decode_merge(const float *partial, int n_parts, float *out) {
    const int row = blockIdx.x;   /* s * n_head + h */
    const float *p = partial + (size_t)row * n_parts * (HD + 2);
    float mx = -INFINITY;
    for (int i = 0; i < n_parts; i++)
        if (p[i * (HD + 2) + HD + 1] > 0.0f) mx = fmaxf(mx, p[i * (HD + 2) + HD]);
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float sum = 0.0f, acc = 0.0f;
        for (int i = 0; i < n_parts; i++) {
            const float *q = p + i * (HD + 2);
            if (q[HD + 1] == 0.0f) continue;
            const float c = __expf(q[HD] - mx);
            sum += q[HD + 1] * c;
            acc += q[d] * c;
        }
        out[(size_t)row * HD + d] = sum > 0.0f ? acc / sum : 0.0f;
    }
}

char last_error[256];

int fail(const char *what, cudaError_t e) {
    snprintf(last_error, sizeof last_error, "%s: %s", what, cudaGetErrorString(e));
    return 1;
}

}  // namespace

extern "C" {

/* The message of the last failing call of this harness. */
const char *pp_cuda_last_error(void) { return last_error; }

/* CUDA devices visible (0 without a GPU or a driver). */
int pp_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
    return n;
}

/* Run the decode kernel on host arrays (copied to the device and back) and
 * time `iters` launches (the kernel alone, after one warm-up) into *ms_per_iter.
 * q: [n_seqs][n_head][head_dim] f32; k_pool, v_pool: [num_slots][n_head_kv *
 * head_dim] f16 bits; block_tables [n_seqs][max_blocks]; seq_lens [n_seqs];
 * out: [n_seqs][n_head][head_dim] f32. part_keys: keys per partition (split-K);
 * 0 picks one partition per 512 keys. Returns 0, or 1 with pp_cuda_last_error(). */
int pp_cuda_paged_decode(const float *q, const uint16_t *k_pool, const uint16_t *v_pool, int64_t num_slots,
                         const int32_t *block_tables, const int32_t *seq_lens, int n_seqs, int n_head,
                         int n_head_kv, int head_dim, int block_size, int max_blocks, int window, float scale,
                         int part_keys, int iters, float *out, float *ms_per_iter) {
    if (head_dim != 64 && head_dim != 128 && head_dim != 256) {
        snprintf(last_error, sizeof last_error, "head_dim %d unsupported (64, 128, 256)", head_dim);
        return 1;
    }
    if (n_head % n_head_kv != 0 || n_head / n_head_kv > PP_MAX_GROUP) {
        snprintf(last_error, sizeof last_error, "GQA group %d/%d unsupported (at most %d)", n_head, n_head_kv,
                 PP_MAX_GROUP);
        return 1;
    }
    int max_len = 0;
    for (int s = 0; s < n_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    const int span = window > 0 && max_len > window ? window : max_len;
    if (part_keys <= 0) part_keys = 512;
    const int n_parts = (span + part_keys - 1) / part_keys > 0 ? (span + part_keys - 1) / part_keys : 1;

    const size_t q_bytes = sizeof(float) * (size_t)n_seqs * n_head * head_dim;
    const size_t pool_bytes = sizeof(uint16_t) * (size_t)num_slots * n_head_kv * head_dim;
    const size_t table_bytes = sizeof(int32_t) * (size_t)n_seqs * max_blocks;
    const size_t part_bytes = sizeof(float) * (size_t)n_seqs * n_head * n_parts * (head_dim + 2);
    void *d_q = nullptr, *d_k = nullptr, *d_v = nullptr, *d_t = nullptr, *d_l = nullptr, *d_p = nullptr,
         *d_o = nullptr;
    cudaEvent_t t0 = nullptr, t1 = nullptr;
    int rc = 0;
    cudaError_t e;
#define TRY(call, what)                    \
    if ((e = (call)) != cudaSuccess) {     \
        rc = fail(what, e);                \
        goto done;                         \
    }
    TRY(cudaMalloc(&d_q, q_bytes), "cudaMalloc q");
    TRY(cudaMalloc(&d_k, pool_bytes), "cudaMalloc k");
    TRY(cudaMalloc(&d_v, pool_bytes), "cudaMalloc v");
    TRY(cudaMalloc(&d_t, table_bytes), "cudaMalloc tables");
    TRY(cudaMalloc(&d_l, sizeof(int32_t) * n_seqs), "cudaMalloc lens");
    TRY(cudaMalloc(&d_p, part_bytes), "cudaMalloc partials");
    TRY(cudaMalloc(&d_o, q_bytes), "cudaMalloc out");
    TRY(cudaMemcpy(d_q, q, q_bytes, cudaMemcpyHostToDevice), "copy q");
    TRY(cudaMemcpy(d_k, k_pool, pool_bytes, cudaMemcpyHostToDevice), "copy k");
    TRY(cudaMemcpy(d_v, v_pool, pool_bytes, cudaMemcpyHostToDevice), "copy v");
    TRY(cudaMemcpy(d_t, block_tables, table_bytes, cudaMemcpyHostToDevice), "copy tables");
    TRY(cudaMemcpy(d_l, seq_lens, sizeof(int32_t) * n_seqs, cudaMemcpyHostToDevice), "copy lens");
    TRY(cudaEventCreate(&t0), "event");
    TRY(cudaEventCreate(&t1), "event");
    {
        decode_args a;
        a.q = (const float *)d_q;
        a.k_pool = (const __half *)d_k;
        a.v_pool = (const __half *)d_v;
        a.block_tables = (const int32_t *)d_t;
        a.seq_lens = (const int32_t *)d_l;
        a.partial = (float *)d_p;
        a.n_head = n_head;
        a.n_head_kv = n_head_kv;
        a.block_size = block_size;
        a.max_blocks = max_blocks;
        a.window = window;
        a.part_keys = part_keys;
        a.n_parts = n_parts;
        a.scale = scale;
        const dim3 grid(n_parts, n_head_kv, n_seqs);
        for (int it = -1; it < (iters > 0 ? iters : 1); it++) {
            if (it == 0) cudaEventRecord(t0);
            switch (head_dim) {
            case 64:
                paged_decode_partial<64><<<grid, PP_WARPS * 32>>>(a);
                paged_decode_merge<64><<<n_seqs * n_head, 64>>>(a.partial, n_parts, (float *)d_o);
                break;
            case 128:
                paged_decode_partial<128><<<grid, PP_WARPS * 32>>>(a);
                paged_decode_merge<128><<<n_seqs * n_head, 128>>>(a.partial, n_parts, (float *)d_o);
                break;
            default:
                paged_decode_partial<256><<<grid, PP_WARPS * 32>>>(a);
                paged_decode_merge<256><<<n_seqs * n_head, 256>>>(a.partial, n_parts, (float *)d_o);
                break;
            }
        }
        TRY(cudaGetLastError(), "kernel launch");
        cudaEventRecord(t1);
        TRY(cudaEventSynchronize(t1), "kernel run");
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, t0, t1);
        if (ms_per_iter) *ms_per_iter = ms / (iters > 0 ? iters : 1);
    }
    TRY(cudaMemcpy(out, d_o, q_bytes, cudaMemcpyDeviceToHost), "copy out");
done:
    if (t0) cudaEventDestroy(t0);
    if (t1) cudaEventDestroy(t1);
    cudaFree(d_q);
    cudaFree(d_k);
    cudaFree(d_v);
    cudaFree(d_t);
    cudaFree(d_l);
    cudaFree(d_p);
    cudaFree(d_o);
    return rc;
#undef TRY
}

}  // extern "C"
