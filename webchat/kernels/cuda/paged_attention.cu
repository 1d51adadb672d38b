// o[i,h] = sum_{p_i - w < j <= p_i} softmax_j(cap(scale q[i,h] . k_b[j,g])) v_b[j,g], b = the sequence owning row i,
// p_i = positions[i], g = h / (n_heads / n_kv), w the sliding window (0: none, every j <= p_i), cap(s) = c tanh(s / c)
// for a soft cap c > 0 (Gemma 2) else s, scale 1 / sqrt(hd) or the model's (Gemma's query_pre_attn_scalar);
// key j of b in slot block_tables[b, j / page_size] * page_size + j % page_size.
// A ragged batch (webchat/model/batch.py): sequence b owns rows [query_start[b], query_start[b+1]); a row sees
// min(p_i + 1, seq_lens[b], max_pages * page_size) keys; rows past query_start[n_seqs] (padding) see none and get 0.
// Flash-decoding: block (split, h, i) takes keys [first + split * chunk, first + (split + 1) * chunk) of its row, first
// the window's first key, chunk = max(MIN_CHUNK, ceil((seen - first) / n_splits)); paged_attention_reduce_* merges
// the splits.
// q, o (T, n_heads, hd); caches (num_pages, page_size, n_kv, hd); part_acc (T, n_heads, n_splits, hd),
// part_ml (T, n_heads, n_splits, 2). Every length is read on the device, so a CUDA graph replays any batch.
#include "flash.cuh"

#define MIN_CHUNK 16  // keys per split at least: shorter rows use fewer splits (the others store "no keys")

// The sequence owning row t: the largest b < n_seqs with query_start[b] <= t (empty sequences own nothing), or -1.
__device__ __forceinline__ int owner(const int* __restrict__ query_start, int n_seqs, int t) {
    if (t < query_start[0] || t >= query_start[n_seqs]) return -1;
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (query_start[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

template <typename T>
__device__ void paged_split_block(const T* __restrict__ q, const T* __restrict__ k_cache,
                                  const T* __restrict__ v_cache, const long long* __restrict__ positions,
                                  const int* __restrict__ query_start, const int* __restrict__ seq_lens,
                                  const int* __restrict__ block_tables, int n_seqs, int max_pages, int page_size,
                                  int n_heads, int n_kv, int head_dim, float scale, float cap, int window,
                                  float* __restrict__ part_acc, float* __restrict__ part_ml) {
    const int split = blockIdx.x, n_splits = gridDim.x, h = blockIdx.y, t = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int b = owner(query_start, n_seqs, t);
    long long seen = 0;  // causal: row t sees keys [0, positions[t]] of its sequence
    if (b >= 0) {
        seen = positions[t] + 1;
        if (seen > seq_lens[b]) seen = seq_lens[b];
        if (seen > (long long)max_pages * page_size) seen = (long long)max_pages * page_size;  // inside the table
    }
    const int n_keys = seen > 0 ? (int)seen : 0;
    const int first = window > 0 && n_keys > window ? n_keys - window : 0;  // the window: keys (p - w, p]
    int chunk = (n_keys - first + n_splits - 1) / n_splits;
    if (chunk < MIN_CHUNK) chunk = MIN_CHUNK;
    const int lo = first + split * chunk;
    const int hi = lo + chunk < n_keys ? lo + chunk : n_keys;
    const int g = h / (n_heads / n_kv);
    const int* table = block_tables + (long)(b > 0 ? b : 0) * max_pages;
    const T* qp = q + ((long)t * n_heads + h) * head_dim;

    float qr[PER_LANE], acc[PER_LANE];  // lane holds dims d = lane + 32 j
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int d = lane + 32 * j;
        qr[j] = d < head_dim ? to_float(qp[d]) * scale : 0.0f;
        acc[j] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;  // online softmax over this warp's keys lo + warp, lo + warp + WARPS, ...
    for (int p = lo + warp; p < hi; p += WARPS) {
        const long slot = (long)table[p / page_size] * page_size + p % page_size;
        const long at = (slot * n_kv + g) * head_dim;  // (slot, g, 0) of (slots, n_kv, hd)
        attend_key(qr, k_cache + at, v_cache + at, lane, head_dim, cap, m, l, acc);
    }
    store_split(m, l, acc, head_dim, ((long)t * n_heads + h) * n_splits + split, part_acc, part_ml);
}

#define PAGED_ATTENTION_ENTRIES(T, SUFFIX)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) paged_attention_split_##SUFFIX(                    \
        const T* q, const T* k_cache, const T* v_cache, const long long* positions, const int* query_start,     \
        const int* seq_lens, const int* block_tables, int n_seqs, int max_pages, int page_size, int n_heads,     \
        int n_kv, int head_dim, float scale, float cap, int window, float* part_acc, float* part_ml) {          \
        paged_split_block<T>(q, k_cache, v_cache, positions, query_start, seq_lens, block_tables, n_seqs,        \
                             max_pages, page_size, n_heads, n_kv, head_dim, scale, cap, window, part_acc,         \
                             part_ml);                                                                          \
    }                                                                                                           \
    extern "C" __global__ void paged_attention_reduce_##SUFFIX(const float* part_acc, const float* part_ml,     \
                                                               T* o, int n_splits, int head_dim) {              \
        attention_reduce_row<T>(part_acc, part_ml, o, n_splits, head_dim);                                      \
    }

PAGED_ATTENTION_ENTRIES(half_t, f16)
PAGED_ATTENTION_ENTRIES(bf16_t, bf16)
PAGED_ATTENTION_ENTRIES(float, f32)
