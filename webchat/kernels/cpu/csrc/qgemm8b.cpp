// A prompt's rows against Q8_0 with int8 activations as a GEMM (docs/quant.md, "qgemm8b.cpp"):
//
//   y[r, n] = one fma chain over blocks b: t = float(I_0) * d_x,0, t = fma(float(I_c), d_x,c, t) for its 8-value
//   groups c = 1 .. 3, acc = fma(t, d_w,b, acc); I_c = sum_{i in c} w_i q_i (exact int32). (d_w once a block: a
//   multiply and an fma a group kept the ports vpdpbusd runs on half busy, as in qpack8.cpp's Q4_0/Q4_1.)
//
// The row kernels (qint8_blocks.inc) keep a lane per 4 values and spend a conversion, a multiply and an fma on every
// 4 values of every (x row, weight row) pair; here a lane is an x row (PanelB: 8 rows side by side, 4 bytes each), a
// weight row's word is broadcast to all of them, and the float steps come once per 8 values. vpdpbusd multiplies
// unsigned by signed bytes: the weights go in as w + 128 (one xor of the broadcast word) and each group takes back
// 128 sum_c q (the panel's c), so I is exact. Without VNNI the same tile takes llama.cpp's sign trick instead: |w|
// (unsigned, the broadcast word's abs once a weight row) times x with w's sign, vpmaddubsw (a pair at most
// 2 * 128 * 127 < 2^15: exact) and vpmaddwd by ones, the same I with nothing to take back. The sums run in this
// file's order on every path (the scalar one with std::fma): a prompt's rows get the same bits however the prompt is
// chunked, with or without VNNI (tests/test_int8.py).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qint8.h"

namespace wq {

namespace {

constexpr int64_t Q8_BYTES = 34;

// ---------------------------------------------------------------- scalar: the order every path follows
void q8_scalar(const Act8& a, int64_t row0, int64_t m, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
               float* y, int64_t ldy) {
  const int64_t nb = a.k / 32;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* q = a.qb.data() + (row0 + r) * a.k;
      const float* dx = a.d8.data() + (row0 + r) * a.k / 4;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + n * row_bytes + b * Q8_BYTES;
        float t = 0.f;
        for (int c = 0; c < 4; ++c) {
          int32_t isum = 0;
          for (int i = 8 * c; i < 8 * c + 8; ++i) isum += static_cast<int8_t>(blk[2 + i]) * q[32 * b + i];
          const float f = static_cast<float>(isum), d = dx[8 * b + 2 * c];
          t = c == 0 ? f * d : std::fma(f, d, t);
        }
        acc = std::fma(t, half_to_float(blk), acc);
      }
      y[r * ldy + n] = acc;
    }
}

// ---------------------------------------------------------------- the tiles
// NR weight rows by GX groups of 8 x rows, every block: each group's 2 words of the NR rows, broadcast once, meet the
// GX panel words; SUMS(w0, w1, x0, x1, cx) gives the group's exact I in each lane (8 int32); 8 float sums in registers
// throughout
#define Q8_TILE(NAME, TARGET, SUMS)                                                                                   \
  template <int NR, int GX>                                                                                           \
  TARGET void NAME(const PanelB& P, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t g0, float* y,           \
                   int64_t ldy, int64_t m) {                                                                          \
    const int64_t nb = P.nb;                                                                                          \
    __m256 acc[NR][GX];                                                                                               \
    for (int n = 0; n < NR; ++n)                                                                                      \
      for (int gx = 0; gx < GX; ++gx) acc[n][gx] = _mm256_setzero_ps();                                               \
    for (int64_t b = 0; b < nb; ++b) {                                                                                \
      __m256 t[NR][GX];                                                                                               \
      for (int c = 0; c < 4; ++c) {                                                                                   \
        __m256i x0[GX], x1[GX], cx[GX];                                                                               \
        __m256 dx[GX];                                                                                                \
        for (int gx = 0; gx < GX; ++gx) {                                                                             \
          const int64_t pb = (g0 + gx) * nb + b;                                                                      \
          x0[gx] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.q.data() + pb * 256 + (2 * c) * 32));        \
          x1[gx] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.q.data() + pb * 256 + (2 * c + 1) * 32));    \
          cx[gx] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.c.data() + pb * 32 + c * 8));                \
          dx[gx] = _mm256_loadu_ps(P.d.data() + pb * 32 + c * 8);                                                     \
        }                                                                                                             \
        for (int n = 0; n < NR; ++n) {                                                                                \
          const uint8_t* wq = w + (n0 + n) * row_bytes + b * Q8_BYTES + 2 + 8 * c;                                    \
          int32_t v0, v1;                                                                                             \
          std::memcpy(&v0, wq, 4), std::memcpy(&v1, wq + 4, 4);                                                       \
          const __m256i w0 = _mm256_set1_epi32(v0), w1 = _mm256_set1_epi32(v1);                                      \
          for (int gx = 0; gx < GX; ++gx) {                                                                           \
            const __m256 f = _mm256_cvtepi32_ps(SUMS(w0, w1, x0[gx], x1[gx], cx[gx]));                                \
            t[n][gx] = c == 0 ? _mm256_mul_ps(f, dx[gx]) : _mm256_fmadd_ps(f, dx[gx], t[n][gx]);                      \
          }                                                                                                           \
        }                                                                                                             \
      }                                                                                                               \
      for (int n = 0; n < NR; ++n) {                                                                                  \
        const __m256 dwv = _mm256_set1_ps(half_to_float(w + (n0 + n) * row_bytes + b * Q8_BYTES));                   \
        for (int gx = 0; gx < GX; ++gx) acc[n][gx] = _mm256_fmadd_ps(t[n][gx], dwv, acc[n][gx]);                      \
      }                                                                                                               \
    }                                                                                                                 \
    for (int gx = 0; gx < GX; ++gx)                                                                                   \
      for (int n = 0; n < NR; ++n) {                                                                                  \
        alignas(32) float out[8];                                                                                     \
        _mm256_store_ps(out, acc[n][gx]);                                                                             \
        for (int r = 0; r < 8 && 8 * (g0 + gx) + r < m; ++r) y[(8 * (g0 + gx) + r) * ldy + n0 + n] = out[r];        \
      }                                                                                                               \
  }

// vpdpbusd: the weights made unsigned (w + 128, an xor of the broadcast word) and 128 sum q (cx) taken back
#define Q8_FLIP(v) _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)))
#define Q8_VNNI(DPBUSD, w0, w1, x0, x1, cx) \
  _mm256_sub_epi32(DPBUSD(DPBUSD(_mm256_setzero_si256(), Q8_FLIP(w0), x0), Q8_FLIP(w1), x1), cx)
#define Q8_AVX512VNNI(w0, w1, x0, x1, cx) Q8_VNNI(_mm256_dpbusd_epi32, w0, w1, x0, x1, cx)
#define Q8_AVXVNNI(w0, w1, x0, x1, cx) Q8_VNNI(_mm256_dpbusd_avx_epi32, w0, w1, x0, x1, cx)
// without VNNI, llama.cpp's sign trick: |w| (-128 -> 0x80: 128 unsigned) times x with w's sign, a word's 4 products a
// pair of vpmaddubsw lanes (at most 2 * 128 * 127 < 2^15) summed by vpmaddwd; nothing to take back (cx unused)
#define Q8_WORD(v, x) _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(x, v)), \
                                        _mm256_set1_epi16(1))
#define Q8_SIGNED(w0, w1, x0, x1, cx) _mm256_add_epi32(Q8_WORD(w0, x0), Q8_WORD(w1, x1))

Q8_TILE(q8_avx512vnni, __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni"))), Q8_AVX512VNNI)
Q8_TILE(q8_avxvnni, __attribute__((target("avx2,fma,f16c,avxvnni"))), Q8_AVXVNNI)
Q8_TILE(q8_avx2, __attribute__((target("avx2,fma,f16c"))), Q8_SIGNED)
#undef Q8_TILE
#undef Q8_FLIP
#undef Q8_VNNI
#undef Q8_AVX512VNNI
#undef Q8_AVXVNNI
#undef Q8_WORD
#undef Q8_SIGNED

using TileB = void (*)(const PanelB&, const uint8_t*, int64_t, int64_t, int64_t, float*, int64_t, int64_t);

// NR weight rows a pass by GX panel groups a tile (their tails: fewer), [NR - 1][GX - 1]: AVX-512 VNNI 4 by 2,
// AVX-VNNI and AVX2 (16 registers) 2 by 2
template <int NRMAX, int GXMAX, int KIND>
void q8_vector(const PanelB& P, int64_t m, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
               int64_t ldy) {
  static constexpr TileB T[4][2] = {
      {q8_avx512vnni<1, 1>, q8_avx512vnni<1, 2>}, {q8_avx512vnni<2, 1>, q8_avx512vnni<2, 2>},
      {q8_avx512vnni<3, 1>, q8_avx512vnni<3, 2>}, {q8_avx512vnni<4, 1>, q8_avx512vnni<4, 2>}};
  static constexpr TileB N[2][2] = {{q8_avxvnni<1, 1>, q8_avxvnni<1, 2>}, {q8_avxvnni<2, 1>, q8_avxvnni<2, 2>}};
  static constexpr TileB A[2][2] = {{q8_avx2<1, 1>, q8_avx2<1, 2>}, {q8_avx2<2, 1>, q8_avx2<2, 2>}};
  for (int64_t n = n0; n < n1; n += NRMAX) {  // NR weight rows stay in L1 while every panel group passes
    const int nr = static_cast<int>(std::min<int64_t>(NRMAX, n1 - n));
    for (int64_t g = 0; g < P.groups; g += GXMAX) {
      const int gx = static_cast<int>(std::min<int64_t>(GXMAX, P.groups - g));
      (KIND == 2 ? T[nr - 1][gx - 1] : KIND == 1 ? N[nr - 1][gx - 1] : A[nr - 1][gx - 1])(P, w, row_bytes, n, g, y,
                                                                                           ldy, m);
    }
  }
}

}  // namespace

void PanelB::build(const Act8& a, int64_t row0, int64_t m) {
  TORCH_CHECK(a.blocks, "the Q8_0 GEMM reads the blocks form, which was not made");
  TORCH_CHECK(row0 >= 0 && row0 + m <= a.m, "rows [", row0, ", ", row0 + m, ") are outside the ", a.m, " quantized");
  groups = (m + 7) / 8, nb = a.k / 32;
  q.assign(groups * nb * 256, 0), c.assign(groups * nb * 32, 0), d.assign(groups * nb * 32, 0.f);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t g = r / 8, l = r % 8, xr = row0 + r;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t pb = g * nb + b;
      const int8_t* src = a.qb.data() + xr * a.k + 32 * b;
      for (int wd = 0; wd < 8; ++wd) std::memcpy(q.data() + pb * 256 + wd * 32 + 4 * l, src + 4 * wd, 4);
      for (int cc = 0; cc < 4; ++cc) {
        int32_t sum = 0;
        for (int i = 8 * cc; i < 8 * cc + 8; ++i) sum += src[i];
        c[pb * 32 + cc * 8 + l] = 128 * sum;
        d[pb * 32 + cc * 8 + l] = a.d8[xr * a.k / 4 + 8 * b + 2 * cc];
      }
    }
  }
}

void q8_gemm_rows(const Act8& a, const PanelB& P, int64_t row0, int64_t m, const uint8_t* w, int64_t row_bytes,
                  int64_t n0, int64_t n1, float* y, int64_t ldy, int p) {
  if (p < PATH_AVX2) return q8_scalar(a, row0, m, w, row_bytes, n0, n1, y, ldy);
  switch (vnni_kind()) {
    case 2: return q8_vector<4, 2, 2>(P, m, w, row_bytes, n0, n1, y, ldy);
    case 1: return q8_vector<2, 2, 1>(P, m, w, row_bytes, n0, n1, y, ldy);
    default: return q8_vector<2, 2, 0>(P, m, w, row_bytes, n0, n1, y, ldy);
  }
}

}  // namespace wq
