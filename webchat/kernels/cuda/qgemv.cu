// y[r, n] = sum_k x[r, k] * w[n, k] with w in ggml blocks of 32 (float accumulation, x and y of type T):
//   Q4_0 (18 B): half d, 16 B nibbles          w = d * (q - 8)
//   Q4_1 (20 B): half d, half m, 16 B nibbles  w = d * q + m
//   Q8_0 (34 B): half d, 32 x int8             w = d * q
// Nibble j < 16 of a block is byte j & 15, element j + 16 is byte j >> 4. One warp per output row; a lane takes a
// quarter block (8 weights) at a time, quarters lane, lane + 32, ..., then the warp sums. Rows r of x loop outside.
#include "common.cuh"

#define QGEMV_WARPS 4  // warps (output rows) per block of 128 threads

__device__ __forceinline__ float half_at(const unsigned char* p) {
    half_t h;
    h.bits = (unsigned short)(p[0] | (p[1] << 8));  // blocks are 18/20/34 bytes: halves may sit on odd addresses
    return to_float(h);
}

// QT: 0 = Q4_0, 1 = Q4_1, 2 = Q8_0
template <typename T, int QT>
__device__ void qgemv_rows(const T* __restrict__ x, const unsigned char* __restrict__ w, T* __restrict__ y, int m,
                           int n, int k, long row_bytes) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * QGEMV_WARPS + (threadIdx.x >> 5);
    if (row >= n) return;  // a whole warp leaves together, so warp_sum below sees full warps only
    const int block_bytes = QT == 0 ? 18 : QT == 1 ? 20 : 34;
    const int quarters = (k / 32) * 4;
    const unsigned char* wrow = w + (long)row * row_bytes;
    for (int r = 0; r < m; ++r) {
        const T* xr = x + (long)r * k;
        float acc = 0.0f;
        for (int item = lane; item < quarters; item += 32) {
            const int b = item >> 2, qtr = item & 3;
            const unsigned char* blk = wrow + (long)b * block_bytes;
            const T* xb = xr + b * 32;
            const float d = half_at(blk);
            float dot = 0.0f;
            if (QT == 2) {
                const signed char* q = (const signed char*)(blk + 2) + qtr * 8;
                for (int i = 0; i < 8; ++i) dot += (float)q[i] * to_float(xb[qtr * 8 + i]);
                acc += d * dot;
            } else {
                const unsigned char* q = blk + (QT == 1 ? 4 : 2) + qtr * 4;
                float xsum = 0.0f;
                for (int i = 0; i < 4; ++i) {
                    const float lo = to_float(xb[qtr * 4 + i]), hi = to_float(xb[16 + qtr * 4 + i]);
                    dot += (float)(q[i] & 15) * lo + (float)(q[i] >> 4) * hi;
                    xsum += lo + hi;
                }
                const float mn = QT == 1 ? half_at(blk + 2) : -8.0f * d;
                acc += d * dot + mn * xsum;
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) y[(long)r * n + row] = from_float<T>(acc);
    }
}

#define QGEMV_ENTRY(T, SUFFIX, QT, QNAME)                                                                          \
    extern "C" __global__ void qgemv_##QNAME##_##SUFFIX(const T* x, const unsigned char* w, T* y, int m, int n,   \
                                                         int k, long row_bytes) {                                  \
        qgemv_rows<T, QT>(x, w, y, m, n, k, row_bytes);                                                            \
    }

QGEMV_ENTRY(half_t, f16, 0, q4_0)
QGEMV_ENTRY(bf16_t, bf16, 0, q4_0)
QGEMV_ENTRY(float, f32, 0, q4_0)
QGEMV_ENTRY(half_t, f16, 1, q4_1)
QGEMV_ENTRY(bf16_t, bf16, 1, q4_1)
QGEMV_ENTRY(float, f32, 1, q4_1)
QGEMV_ENTRY(half_t, f16, 2, q8_0)
QGEMV_ENTRY(bf16_t, bf16, 2, q8_0)
QGEMV_ENTRY(float, f32, 2, q8_0)
