// o[t,h] = sum_{j <= start+t} softmax_j(q[t,h] . k[g,j] / sqrt(hd)) v[g,j], g = h / (n_heads / n_kv)  (causal GQA).
// Flash-decoding: attention_split_* gives each (split, head, token) block a chunk of keys and writes the partial
// max m, sum l = sum_j exp(s_j - m) and acc = sum_j exp(s_j - m) v_j (float32); attention_reduce_* merges the splits.
// q (T, n_heads, hd); cache (n_kv, capacity, hd); start = *start_ptr if non-null, else start_host.
// part_acc (T, n_heads, n_splits, hd), part_ml (T, n_heads, n_splits, 2); o (T, n_heads, hd).
#include "flash.cuh"

template <typename T>
__device__ void attention_split_block(const T* __restrict__ q, const T* __restrict__ cache_k,
                                      const T* __restrict__ cache_v, const int* __restrict__ start_ptr,
                                      int start_host, int n_heads, int n_kv, int head_dim, int capacity, float scale,
                                      float* __restrict__ part_acc, float* __restrict__ part_ml) {
    const int split = blockIdx.x, n_splits = gridDim.x, h = blockIdx.y, t = blockIdx.z, n_tokens = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int start = start_ptr ? *start_ptr : start_host;
    const int chunk = (start + n_tokens + n_splits - 1) / n_splits;  // keys per split, sized for the last query
    const int lo = split * chunk;
    const int seen = start + t + 1;  // causal: query t sees keys [0, start + t]
    const int hi = lo + chunk < seen ? lo + chunk : seen;
    const int g = h / (n_heads / n_kv);
    const T* kh = cache_k + (long)g * capacity * head_dim;
    const T* vh = cache_v + (long)g * capacity * head_dim;
    const T* qp = q + ((long)t * n_heads + h) * head_dim;

    float qr[PER_LANE], acc[PER_LANE];  // lane holds dims d = lane + 32 j
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int d = lane + 32 * j;
        qr[j] = d < head_dim ? to_float(qp[d]) * scale : 0.0f;
        acc[j] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;  // online softmax over this warp's keys lo + warp, lo + warp + WARPS, ...
    for (int p = lo + warp; p < hi; p += WARPS)
        attend_key(qr, kh + (long)p * head_dim, vh + (long)p * head_dim, lane, head_dim, m, l, acc);
    store_split(m, l, acc, head_dim, ((long)t * n_heads + h) * n_splits + split, part_acc, part_ml);
}

#define ATTENTION_ENTRIES(T, SUFFIX)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) attention_split_##SUFFIX(                          \
        const T* q, const T* cache_k, const T* cache_v, const int* start_ptr, int start_host, int n_heads,       \
        int n_kv, int head_dim, int capacity, float scale, float* part_acc, float* part_ml) {                   \
        attention_split_block<T>(q, cache_k, cache_v, start_ptr, start_host, n_heads, n_kv, head_dim, capacity, \
                                 scale, part_acc, part_ml);                                                     \
    }                                                                                                           \
    extern "C" __global__ void attention_reduce_##SUFFIX(const float* part_acc, const float* part_ml, T* o,     \
                                                         int n_splits, int head_dim) {                          \
        attention_reduce_row<T>(part_acc, part_ml, o, n_splits, head_dim);                                      \
    }

ATTENTION_ENTRIES(half_t, f16)
ATTENTION_ENTRIES(bf16_t, bf16)
ATTENTION_ENTRIES(float, f32)
