// cache_k[h, start + t, :] = k[t, h, :]; cache_v likewise. cache (n_kv, capacity, hd), k/v (T, n_kv, hd).
// start = *start_ptr when start_ptr is non-null (a CUDA graph replays at any position), else start_host.
#include "common.cuh"

template <typename T>
__device__ void kv_append_elem(T* __restrict__ cache_k, T* __restrict__ cache_v, const T* __restrict__ k,
                               const T* __restrict__ v, const int* __restrict__ start_ptr, int start_host,
                               int n_tokens, int n_kv, int head_dim, int capacity) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n_tokens * n_kv * head_dim) return;
    const int d = (int)(idx % head_dim);
    const int h = (int)((idx / head_dim) % n_kv);
    const int t = (int)(idx / ((long)head_dim * n_kv));
    const int pos = (start_ptr ? *start_ptr : start_host) + t;
    if (pos < 0 || pos >= capacity) return;  // the host checks the bounds; never write outside the cache
    const long dst = ((long)h * capacity + pos) * head_dim + d;
    cache_k[dst] = k[idx];
    cache_v[dst] = v[idx];
}

#define KV_APPEND_ENTRY(T, SUFFIX)                                                                              \
    extern "C" __global__ void kv_append_##SUFFIX(T* cache_k, T* cache_v, const T* k, const T* v,              \
                                                  const int* start_ptr, int start_host, int n_tokens, int n_kv, \
                                                  int head_dim, int capacity) {                                 \
        kv_append_elem<T>(cache_k, cache_v, k, v, start_ptr, start_host, n_tokens, n_kv, head_dim, capacity);  \
    }

KV_APPEND_ENTRY(half_t, f16)
KV_APPEND_ENTRY(bf16_t, bf16)
KV_APPEND_ENTRY(float, f32)
