// Flash-decoding's parts (paged_attention.cu): a block's warps each hold an online softmax
// (max m, sum l = sum_j exp(s_j - m), acc = sum_j exp(s_j - m) v_j) over their keys; merged and stored per split, and
// the splits reduced per row: o = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, M = max_s m_s.
#pragma once
#include "common.cuh"

#define WARPS 4                      // blockDim.x == 32 * WARPS for the split kernels
#define MAX_HD 256
#define PER_LANE (MAX_HD / 32)

// One key for one warp: s = q . k (q pre-scaled; lane holds dims d = lane + 32 j), soft-capped to
// cap * tanh(s / cap) where cap > 0 (Gemma 2), then the online-softmax update.
template <typename T>
__device__ __forceinline__ void attend_key(const float* qr, const T* __restrict__ kp, const T* __restrict__ vp,
                                           int lane, int head_dim, float cap, float& m, float& l, float* acc) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int d = lane + 32 * j;
        if (d < head_dim) s += qr[j] * to_float(kp[d]);
    }
    s = warp_sum(s);
    if (cap > 0.0f) s = tanhf(s / cap) * cap;
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new);  // 0 on the first key (m = -inf)
    const float e = expf(s - m_new);
    l = l * corr + e;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int d = lane + 32 * j;
        if (d < head_dim) acc[j] = acc[j] * corr + e * to_float(vp[d]);
    }
    m = m_new;
}

// Merge the WARPS warps' (m, l, acc) and store the split's partials at index `part` of
// part_acc (rows, n_splits, hd) and part_ml (rows, n_splits, 2); a split with no keys stores m = -inf, l = 0, acc = 0.
__device__ __forceinline__ void store_split(float m, float l, const float* acc, int head_dim, long part,
                                            float* __restrict__ part_acc, float* __restrict__ part_ml) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ float s_m[WARPS], s_l[WARPS];
    __shared__ float s_acc[WARPS][MAX_HD];
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int d = lane + 32 * j;
        if (d < head_dim) s_acc[warp][d] = acc[j];
    }
    __syncthreads();
    float mb = NEG_INF;
    for (int w = 0; w < WARPS; ++w) mb = fmaxf(mb, s_m[w]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < WARPS; ++w)
            if (s_m[w] != NEG_INF) a += s_acc[w][d] * expf(s_m[w] - mb);
        part_acc[part * head_dim + d] = a;
    }
    if (threadIdx.x == 0) {
        float lb = 0.0f;
        for (int w = 0; w < WARPS; ++w)
            if (s_m[w] != NEG_INF) lb += s_l[w] * expf(s_m[w] - mb);
        part_ml[part * 2] = mb;
        part_ml[part * 2 + 1] = lb;
    }
}

// One block per (t, h) row: merges the row's n_splits partials into o (rows, hd); a row with no keys at all gets 0.
template <typename T>
__device__ void attention_reduce_row(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                     T* __restrict__ o, int n_splits, int head_dim) {
    const long row = blockIdx.x;
    const float* ml = part_ml + row * n_splits * 2;
    const float* acc = part_acc + row * n_splits * head_dim;
    float big = NEG_INF;
    for (int s = 0; s < n_splits; ++s) big = fmaxf(big, ml[2 * s]);
    float total = 0.0f;
    for (int s = 0; s < n_splits; ++s)
        if (ml[2 * s] != NEG_INF) total += ml[2 * s + 1] * expf(ml[2 * s] - big);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_splits; ++s)
            if (ml[2 * s] != NEG_INF) a += acc[(long)s * head_dim + d] * expf(ml[2 * s] - big);
        o[row * head_dim + d] = from_float<T>(total > 0.0f ? a / total : 0.0f);
    }
}
