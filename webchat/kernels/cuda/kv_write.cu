// cache[slot_mapping[t], h, :] = k[t, h, :] (v likewise); cache (num_pages, page_size, n_kv, hd) seen as (slots, n_kv,
// hd), slot = page * page_size + offset; k/v (T, n_kv, hd); slot_mapping (T,) int64. One thread per element of k.
#include "common.cuh"

template <typename T>
__device__ void kv_write_elem(T* __restrict__ k_cache, T* __restrict__ v_cache, const T* __restrict__ k,
                              const T* __restrict__ v, const long long* __restrict__ slot_mapping, int n_tokens,
                              int n_kv, int head_dim, long long n_slots) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long per_token = (long)n_kv * head_dim;
    if (idx >= n_tokens * per_token) return;
    const long long slot = slot_mapping[idx / per_token];
    if (slot < 0 || slot >= n_slots) return;  // the host cannot check device slots; never write outside the cache
    const long dst = (long)slot * per_token + idx % per_token;
    k_cache[dst] = k[idx];
    v_cache[dst] = v[idx];
}

#define KV_WRITE_ENTRY(T, SUFFIX)                                                                               \
    extern "C" __global__ void kv_write_##SUFFIX(T* k_cache, T* v_cache, const T* k, const T* v,                \
                                                 const long long* slot_mapping, int n_tokens, int n_kv,          \
                                                 int head_dim, long long n_slots) {                              \
        kv_write_elem<T>(k_cache, v_cache, k, v, slot_mapping, n_tokens, n_kv, head_dim, n_slots);              \
    }

KV_WRITE_ENTRY(half_t, f16)
KV_WRITE_ENTRY(bf16_t, bf16)
KV_WRITE_ENTRY(float, f32)
