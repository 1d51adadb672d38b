// A prompt's rows as a GEMM: y (m, n) = x (m, k) @ W^T with W dequantized to float32 a tile of TILE rows at a time
// and reused by every row of x (docs/quant.md, `qgemm.cpp`).
//
// The row kernels (qmatmul.cpp, qkquant.cpp) decode each weight block once per group of up to 4-8 rows and spend
// about as many vector operations on the decoding and the per-block scales as on the products: ~43 GMAC/s on two
// AVX-512 cores however many rows come. Here a weight is decoded once per call, and then each output is one chain
// of fused multiply-adds over k, LANES wide, summed across its lanes at the end: y[r, n] = hsum_l(sum over c = l
// (mod LANES) of x[r, c] * w[n, c]) + the tail past the last whole vector, in order. Each output depends on its row
// of x and its row of W only, never on how many rows came or how they were grouped, so a prompt's k/v are the same
// however the prompt is chunked. The weights are the float32 values dequant_row gives (the PyTorch path's
// dequantized matrices), the products float32: exact to float32 up to the order of the additions, like every path.
//
// Threads: the tiles of every matrix of a call are split over torch's OpenMP pool, as the row kernels' rows are.
// A matrix packed 8 rows to a group for the int8 kernels (MatRef.packed, qpack8.cpp) has each tile's groups put back
// into ggml's layout before they are dequantized (packed_group): the same floats as the file's rows give.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qcommon.h"
#include "qint8.h"

namespace wq {

constexpr int64_t TILE = 16;  // weight rows dequantized together: 16 x k floats stay in L1/L2 while x passes

#define WQ_AVX2 __attribute__((target("avx2,fma,f16c")))
#define WQ_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))

// One row of W as float32: w = d * (q - 8) (Q4_0), d * q + m (Q4_1), d * q (Q8_0), in that order of operations on
// every path (a subtraction, a multiply, an add: the vector paths give the scalar path's values bit for bit).
static void dequant_q_scalar(int qtype, const uint8_t* row, int64_t k, float* out) {
  const int64_t bb = block_bytes(qtype);
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* blk = row + b * bb;
    const float d = half_to_float(blk);
    float* o = out + b * 32;
    if (qtype == Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int i = 0; i < 32; ++i) o[i] = d * float(q[i]);
    } else {
      const uint8_t* q = blk + (qtype == Q4_1 ? 4 : 2);
      const float m = qtype == Q4_1 ? half_to_float(blk + 2) : 0.f;
      const float off = qtype == Q4_1 ? 0.f : 8.f;
      for (int i = 0; i < 16; ++i) {
        o[i] = d * (float(q[i] & 15) - off) + m;
        o[i + 16] = d * (float(q[i] >> 4) - off) + m;
      }
    }
  }
}

// Q5_0 / Q5_1: q of 5 bits, the fifth from qh (bit i: value i); w = d * (q - 16) + 0 (Q5_0), d * q + m (Q5_1), the
// same order of operations as above. One form for every path (the compiler's AVX2 clone where the CPU has it).
__attribute__((target_clones("arch=haswell", "default"))) static void dequant_q5(int qtype, const uint8_t* row,
                                                                                  int64_t k, float* out) {
  const int64_t bb = block_bytes(qtype);
  const bool one = qtype == Q5_1;
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* blk = row + b * bb;
    const float d = half_to_float(blk), m = one ? half_to_float(blk + 2) : 0.f, off = one ? 0.f : 16.f;
    uint32_t qh;
    std::memcpy(&qh, blk + (one ? 4 : 2), 4);
    const uint8_t* q = blk + (one ? 8 : 6);
    float* o = out + b * 32;
    for (int i = 0; i < 16; ++i) {
      o[i] = d * (float((q[i] & 15) | (((qh >> i) & 1) << 4)) - off) + m;
      o[i + 16] = d * (float((q[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - off) + m;
    }
  }
}

WQ_AVX512 static void dequant_q_avx512(int qtype, const uint8_t* row, int64_t k, float* out) {
  const int64_t bb = block_bytes(qtype);
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* blk = row + b * bb;
    uint16_t h;
    std::memcpy(&h, blk, 2);
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(h));
    float* o = out + b * 32;
    if (qtype == Q8_0) {
      for (int i = 0; i < 2; ++i) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * i));
        _mm512_storeu_ps(o + 16 * i, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
      }
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (qtype == Q4_1 ? 4 : 2)));
      uint16_t hm = 0;
      if (qtype == Q4_1) std::memcpy(&hm, blk + 2, 2);
      const __m512 m = _mm512_set1_ps(qtype == Q4_1 ? _cvtsh_ss(hm) : 0.f);
      const __m512 off = _mm512_set1_ps(qtype == Q4_1 ? 0.f : 8.f);
      const __m128i halves[2] = {_mm_and_si128(q, low), _mm_and_si128(_mm_srli_epi16(q, 4), low)};
      for (int i = 0; i < 2; ++i) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(halves[i]));
        _mm512_storeu_ps(o + 16 * i, _mm512_add_ps(_mm512_mul_ps(d, _mm512_sub_ps(f, off)), m));
      }
    }
  }
}

WQ_AVX2 static void dequant_q_avx2(int qtype, const uint8_t* row, int64_t k, float* out) {
  const int64_t bb = block_bytes(qtype);
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* blk = row + b * bb;
    uint16_t h;
    std::memcpy(&h, blk, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
    float* o = out + b * 32;
    if (qtype == Q8_0) {
      for (int i = 0; i < 4; ++i) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
        _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
      }
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (qtype == Q4_1 ? 4 : 2)));
      uint16_t hm = 0;
      if (qtype == Q4_1) std::memcpy(&hm, blk + 2, 2);
      const __m256 m = _mm256_set1_ps(qtype == Q4_1 ? _cvtsh_ss(hm) : 0.f);
      const __m256 off = _mm256_set1_ps(qtype == Q4_1 ? 0.f : 8.f);
      const __m128i halves[2] = {_mm_and_si128(q, low), _mm_and_si128(_mm_srli_epi16(q, 4), low)};
      for (int i = 0; i < 4; ++i) {  // values 8i .. 8i + 7: bytes 8 (i % 2) .. of half i / 2
        const __m128i bytes = i % 2 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        _mm256_storeu_ps(o + 8 * i, _mm256_add_ps(_mm256_mul_ps(d, _mm256_sub_ps(f, off)), m));
      }
    }
  }
}

void dequant_row(int qtype, const uint8_t* row, int64_t k, float* out) {
  if (qtype == F32) return static_cast<void>(std::memcpy(out, row, k * sizeof(float)));
  if (is_kquant(qtype)) return kq_dequant_row(qtype, row, k, out);
  if (qtype == Q5_0 || qtype == Q5_1) return dequant_q5(qtype, row, k, out);
  const int p = path();
  if (p == PATH_AVX512) return dequant_q_avx512(qtype, row, k, out);
  if (p == PATH_AVX2) return dequant_q_avx2(qtype, row, k, out);
  dequant_q_scalar(qtype, row, k, out);
}

// MR rows of x against NR rows of W, LANES floats a step; one body, written once for each vector width
#define WQ_GEMM_MICRO(NAME, TARGET, VEC, ZERO, LOADU, FMA, HSUM, LANES)                                              \
  template <int MR, int NR>                                                                                          \
  TARGET static void NAME(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* y,            \
                          int64_t ldy) {                                                                             \
    const int64_t kv = k / LANES * LANES;                                                                            \
    VEC acc[MR][NR];                                                                                                 \
    for (int r = 0; r < MR; ++r)                                                                                     \
      for (int n = 0; n < NR; ++n) acc[r][n] = ZERO();                                                               \
    for (int64_t c = 0; c < kv; c += LANES) {                                                                        \
      VEC wv[NR];                                                                                                    \
      for (int n = 0; n < NR; ++n) wv[n] = LOADU(w + n * ldw + c);                                                   \
      for (int r = 0; r < MR; ++r) {                                                                                 \
        const VEC xv = LOADU(x + r * ldx + c);                                                                       \
        for (int n = 0; n < NR; ++n) acc[r][n] = FMA(xv, wv[n], acc[r][n]);                                          \
      }                                                                                                              \
    }                                                                                                                \
    for (int r = 0; r < MR; ++r)                                                                                     \
      for (int n = 0; n < NR; ++n) {                                                                                 \
        float s = HSUM(acc[r][n]);                                                                                   \
        for (int64_t c = kv; c < k; ++c) s += x[r * ldx + c] * w[n * ldw + c];                                       \
        y[r * ldy + n] = s;                                                                                          \
      }                                                                                                              \
  }

WQ_GEMM_MICRO(micro_avx2, WQ_AVX2, __m256, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, hsum256, 8)
WQ_GEMM_MICRO(micro_avx512, WQ_AVX512, __m512, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
              _mm512_reduce_add_ps, 16)
#undef WQ_GEMM_MICRO

template <int MR, int NR>  // any x86-64: each output one chain over k, in order
static void micro_scalar(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* y, int64_t ldy) {
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) {
      float s = 0.f;
      for (int64_t c = 0; c < k; ++c) s += x[r * ldx + c] * w[n * ldw + c];
      y[r * ldy + n] = s;
    }
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);
#define WQ_ROW(F, MR) {F<MR, 1>, F<MR, 2>, F<MR, 3>, F<MR, 4>}
constexpr int64_t MR_MAX = 6;  // rows of x a step: AVX-512 6 x 4 accumulators, AVX2 6 x 2 (and their operands)
static const Micro MICRO[3][MR_MAX][4] = {
    {WQ_ROW(micro_scalar, 1), WQ_ROW(micro_scalar, 2), WQ_ROW(micro_scalar, 3), WQ_ROW(micro_scalar, 4),
     WQ_ROW(micro_scalar, 5), WQ_ROW(micro_scalar, 6)},
    {WQ_ROW(micro_avx2, 1), WQ_ROW(micro_avx2, 2), WQ_ROW(micro_avx2, 3), WQ_ROW(micro_avx2, 4), WQ_ROW(micro_avx2, 5),
     WQ_ROW(micro_avx2, 6)},
    {WQ_ROW(micro_avx512, 1), WQ_ROW(micro_avx512, 2), WQ_ROW(micro_avx512, 3), WQ_ROW(micro_avx512, 4),
     WQ_ROW(micro_avx512, 5), WQ_ROW(micro_avx512, 6)},
};
#undef WQ_ROW

void qgemm_multi(const float* x, int64_t m, int64_t k, const MatRef* mats, int count, bool amx_ok) {
  if (m == 0) return;
  if (amx_ok && amx_covers(mats, count, k)) return qgemm_amx_multi(x, m, k, mats, count);
  const int p = path();
  const int64_t nr_max = p == PATH_AVX2 ? 2 : 4;  // AVX2 has 16 registers, AVX-512 32
  // rows in passes of at most MR_MAX, as even as they go (10 rows: 5 + 5, not 6 + 4 or 4 + 4 + 2)
  const int64_t passes = (m + MR_MAX - 1) / MR_MAX, base = m / passes, extra = m % passes;
  std::vector<std::pair<int, int64_t>> tiles;  // (matrix, first row)
  for (int i = 0; i < count; ++i)
    for (int64_t n0 = 0; n0 < mats[i].n; n0 += TILE) tiles.emplace_back(i, n0);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t a, int64_t b) {
    thread_local std::vector<float> buf;
    thread_local std::vector<uint8_t> gathered;
    for (int64_t t = a; t < b; ++t) {
      const MatRef& mr = mats[tiles[t].first];
      const int64_t n0 = tiles[t].second, nn = std::min(TILE, mr.n - n0);
      const uint8_t* rows = mr.w + n0 * mr.row_bytes;
      const float* w;
      if (mr.qtype == F32) {
        w = reinterpret_cast<const float*>(rows);
      } else {
        buf.resize(TILE * k);
        if (mr.packed) {  // packed 8 rows to a group for the int8 kernels: the tile's rows in ggml's layout first
          gathered.resize(TILE * mr.row_bytes);
          for (int64_t g = 0; g < nn / 8; ++g)
            packed_group(mr.qtype, mr.w, mr.row_bytes, n0 / 8 + g, gathered.data() + g * 8 * mr.row_bytes);
          rows = gathered.data();
        }
        for (int64_t i = 0; i < nn; ++i) dequant_row(mr.qtype, rows + i * mr.row_bytes, k, buf.data() + i * k);
        w = buf.data();
      }
      for (int64_t i = 0, r0 = 0; i < passes; r0 += base + (i < extra), ++i) {  // rows of x in L1, the tile's passing
        const int64_t mm = base + (i < extra);
        for (int64_t c0 = 0; c0 < nn; c0 += nr_max) {
          const int64_t nr = std::min(nr_max, nn - c0);
          MICRO[p][mm - 1][nr - 1](x + r0 * k, k, w + c0 * k, k, k, mr.y + r0 * mr.n + n0 + c0, mr.n);
        }
      }
    }
  });
}

}  // namespace wq
