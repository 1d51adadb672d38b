// x = logits + bias; seen (count > 0): x = x > 0 ? x / rp : x * rp; x = x - freq * count - presence * [count > 0].
// The logits-row adjustments of webchat.engine.sampling.Sampler._adjust, one thread per vocabulary entry, float32.
// sample_count_f32 first builds count[id] over the history window (ids outside [0, vocab) are ignored).
#include "common.cuh"

extern "C" __global__ void sample_count_f32(const int* __restrict__ ids, int n, float* __restrict__ counts, int vocab) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int id = ids[i];
    if (id >= 0 && id < vocab) atomicAdd(counts + id, 1.0f);
}

// bias and counts may be null (no token bias; no penalties)
extern "C" __global__ void sample_adjust_f32(const float* __restrict__ logits, const float* __restrict__ bias,
                                             const float* __restrict__ counts, float* __restrict__ x, int vocab,
                                             float repetition, float frequency, float presence) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vocab) return;
    float v = logits[i];
    if (bias) v = __fadd_rn(v, bias[i]);
    if (counts) {
        const float c = counts[i];
        if (c > 0.0f) v = v > 0.0f ? __fdiv_rn(v, repetition) : __fmul_rn(v, repetition);
        v = __fsub_rn(v, __fmul_rn(frequency, c));  // torch order: (x - f * count) - p * seen
        v = __fsub_rn(v, c > 0.0f ? presence : 0.0f);
    }
    x[i] = v;
}
