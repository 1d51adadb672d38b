// Shared by every kernel: 16-bit storage types with float conversions, and warp/block sums.
// No CUDA headers are included, so NVRTC (through CuPy) needs no include path.
#pragma once

struct __align__(2) half_t { unsigned short bits; };  // IEEE binary16, torch.float16
struct __align__(2) bf16_t { unsigned short bits; };  // bfloat16, torch.bfloat16

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half_t x) {
#ifdef WEBCHAT_EMULATOR  // compiled for the host by webchat/kernels/cuda/emulator.py
    return webchat_emu_half_to_float(x.bits);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
#endif
}
__device__ __forceinline__ float to_float(bf16_t x) { return __uint_as_float(((unsigned int)x.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ half_t from_float<half_t>(float f) {
    half_t h;
#ifdef WEBCHAT_EMULATOR
    h.bits = webchat_emu_float_to_half(f);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
#endif
    return h;
}
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
    bf16_t h;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
#else  // round to nearest even by hand (no bf16 cvt before sm_80, nor on the host)
    const unsigned int u = __float_as_uint(f);
    h.bits = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)0x7fc0u
                                              : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
    return h;
}

// round f to T and back: what torch gets when it stores an intermediate in T
template <typename T> __device__ __forceinline__ float round_to(float f) { return to_float(from_float<T>(f)); }

#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block; blockDim.x must be a multiple of 32 and at most 1024. Every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = (lane < n_warps) ? partial[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();  // partial may be reused by the next call
    return v;
}
