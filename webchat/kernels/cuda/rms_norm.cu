// r = x + residual (add_rms_norm only); y = w * (T)(r / sqrt(mean(r*r) + eps)), statistics in float32.
// One block per row of length dim; blockDim.x a multiple of 32. Rounds like webchat.model.ops.TorchOps.
#include "common.cuh"

template <typename T, bool ADD>
__device__ void rms_norm_row(const T* __restrict__ x, const T* __restrict__ residual, const T* __restrict__ w,
                             T* __restrict__ y, T* __restrict__ residual_out, int dim, float eps) {
    const long row = blockIdx.x;
    x += row * dim;
    y += row * dim;
    if (ADD) {
        residual += row * dim;
        residual_out += row * dim;
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float r = to_float(x[i]);
        if (ADD) {
            const T rt = from_float<T>(r + to_float(residual[i]));  // residual' is stored in T
            residual_out[i] = rt;
            r = to_float(rt);
        }
        ss += r * r;
    }
    const float inv = rsqrtf(block_sum(ss) / (float)dim + eps);
    const T* src = ADD ? residual_out : x;  // each thread rereads only the elements it wrote
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float n = round_to<T>(to_float(src[i]) * inv);
        y[i] = from_float<T>(to_float(w[i]) * n);
    }
}

#define RMS_NORM_ENTRIES(T, SUFFIX)                                                                              \
    extern "C" __global__ void rms_norm_##SUFFIX(const T* x, const T* w, T* y, int dim, float eps) {           \
        rms_norm_row<T, false>(x, nullptr, w, y, nullptr, dim, eps);                                            \
    }                                                                                                           \
    extern "C" __global__ void add_rms_norm_##SUFFIX(const T* x, const T* residual, const T* w, T* y,          \
                                                     T* residual_out, int dim, float eps) {                     \
        rms_norm_row<T, true>(x, residual, w, y, residual_out, dim, eps);                                       \
    }

RMS_NORM_ENTRIES(half_t, f16)
RMS_NORM_ENTRIES(bf16_t, bf16)
RMS_NORM_ENTRIES(float, f32)
