// In place, rotate_half layout, h = hd/2: x[i] <- x[i]*cos[i] - x[i+h]*sin[i]; x[i+h] <- x[i+h]*cos[i] + x[i]*sin[i].
// q (T, n_heads, hd), k (T, n_kv, hd), cos/sin (T, hd/2) float32; one thread per (t, head, i) pair, i < h.
// cos/sin are rounded to T and every product and sum stored in T, as webchat.model.ops.TorchOps does.
#include "common.cuh"

template <typename T>
__device__ void rope_pairs(T* __restrict__ q, T* __restrict__ k, const float* __restrict__ cos,
                           const float* __restrict__ sin, int n_tokens, int n_heads, int n_kv, int head_dim) {
    const int half = head_dim / 2, heads = n_heads + n_kv;
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n_tokens * heads * half) return;
    const int i = (int)(idx % half);
    const int head = (int)((idx / half) % heads);
    const int t = (int)(idx / ((long)half * heads));
    T* x = head < n_heads ? q + ((long)t * n_heads + head) * head_dim
                          : k + ((long)t * n_kv + (head - n_heads)) * head_dim;
    const float c = round_to<T>(cos[(long)t * half + i]);
    const float s = round_to<T>(sin[(long)t * half + i]);
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    // __fmul_rn/__fadd_rn: no fused multiply-add, so float32 rounds like torch's separate ops too
    const float a1 = round_to<T>(__fmul_rn(x1, c)), b1 = round_to<T>(__fmul_rn(-x2, s));
    const float a2 = round_to<T>(__fmul_rn(x2, c)), b2 = round_to<T>(__fmul_rn(x1, s));
    x[i] = from_float<T>(__fadd_rn(a1, b1));
    x[i + half] = from_float<T>(__fadd_rn(a2, b2));
}

#define ROPE_ENTRY(T, SUFFIX)                                                                                   \
    extern "C" __global__ void rope_##SUFFIX(T* q, T* k, const float* cos, const float* sin, int n_tokens,     \
                                             int n_heads, int n_kv, int head_dim) {                              \
        rope_pairs<T>(q, k, cos, sin, n_tokens, n_heads, n_kv, head_dim);                                       \
    }

ROPE_ENTRY(half_t, f16)
ROPE_ENTRY(bf16_t, bf16)
ROPE_ENTRY(float, f32)
