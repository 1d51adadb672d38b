// y = act(gate) * up elementwise over n values: silu_mul's act(g) = (T)(g / (1 + exp(-g))), gelu_tanh_mul's (Gemma)
// act(g) = (T)(0.5 g (1 + tanh(b (g + k g^3)))), PyTorch's gelu(approximate="tanh").
#include "common.cuh"

template <typename T>
__device__ void silu_mul_elem(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ y, long n) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = to_float(gate[i]);
    const float s = round_to<T>(g / (1.0f + expf(-g)));  // F.silu stores its result in T
    y[i] = from_float<T>(s * to_float(up[i]));
}

template <typename T>
__device__ void gelu_tanh_mul_elem(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ y, long n) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = to_float(gate[i]);
    const float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    const float a = round_to<T>(0.5f * g * (1.0f + tanhf(inner)));  // F.gelu stores its result in T
    y[i] = from_float<T>(a * to_float(up[i]));
}

#define SILU_MUL_ENTRY(T, SUFFIX)                                                                               \
    extern "C" __global__ void silu_mul_##SUFFIX(const T* gate, const T* up, T* y, long n) {                  \
        silu_mul_elem<T>(gate, up, y, n);                                                                       \
    }                                                                                                           \
    extern "C" __global__ void gelu_tanh_mul_##SUFFIX(const T* gate, const T* up, T* y, long n) {             \
        gelu_tanh_mul_elem<T>(gate, up, y, n);                                                                  \
    }

SILU_MUL_ENTRY(half_t, f16)
SILU_MUL_ENTRY(bf16_t, bf16)
SILU_MUL_ENTRY(float, f32)
