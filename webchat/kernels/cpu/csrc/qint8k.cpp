// The K-quants (Q4_K, Q5_K, Q6_K) against int8 activations in the super-blocks form (qint8.h, docs/quant.md).
//
//   y = sum_i [ d_w dk_x sum_l isum_l - dmin_w dk_x sum_j m_j pq_j ]   over super-blocks i,
//   isum_l = sum over the 8 sub-blocks v of S_g sum_{t = 4l .. 4l + 3} w_{32v + t} q_{32v + t}
// with w the weight's integer (Q4_K q, Q5_K q, Q6_K q - 32), S_g the integer scale of its group of 16: Q4_K/Q5_K
// sc_v p_v (6 bits times the activation's power of two), Q6_K sc_g p_v (int8 times it), g = 2v + (t >= 16). Every
// integer is exact (int16 pairs: |w q| pairs <= 2 * 63 * 127 and, Q6_K, 2 * 32 * 127; int32 lanes < 2^31, Q6_K's
// worst case 32 * 4064 * 16384 = 2,130,706,432), so the paths differ only where the float steps would, and they take
// them alike: per super-block and lane acc_l = fma(d_w dk, isum_l, acc_l), macc = fma(dmin_w dk, msum, macc),
// y = hsum(acc) - macc. The AVX2 form is llama.cpp's Q4_K x Q8_K loop (ggml-cpu/arch/x86/quants.c: vpmaddubsw, then
// vpmaddwd by the sub-block's scale) with the scale times the activation's power of two.
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qint8.h"
#include "qkblocks.h"

namespace wq {

namespace {

// ---------------------------------------------------------------- scalar: the order every path follows
template <int QT>
void rows_scalar(const Job8& j, int64_t n0, int64_t n1) {
  const int64_t nsb = j.k / QK_K;
  const Act8& a = *j.a;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    for (int r = 0; r < j.m; ++r) {
      const int64_t xr = j.r0 + r;
      float acc[8] = {}, macc = 0.f;
      for (int64_t i = 0; i < nsb; ++i) {
        const uint8_t* blk = row + i * kbytes<QT>();
        const int8_t* q = a.qs.data() + xr * j.k + i * QK_K;
        const int16_t* p = a.p.data() + (xr * nsb + i) * 8;
        int w[QK_K], sc[16], mn[8];
        super_ints<QT>(blk, w, sc, mn);
        int32_t isum[8] = {};
        for (int v = 0; v < 8; ++v)
          for (int t = 0; t < 32; ++t) isum[(t % 32) / 4] += sc[2 * v + t / 16] * p[v] * w[32 * v + t] * q[32 * v + t];
        const float dk = a.dk[xr * nsb + i];
        const float dd = half_to_float(blk + (QT == Q6_K ? 208 : 0)) * dk;
        for (int l = 0; l < 8; ++l) acc[l] = std::fma(dd, static_cast<float>(isum[l]), acc[l]);
        if (QT != Q6_K) {
          int32_t msum = 0;
          for (int v = 0; v < 8; ++v) msum += mn[v] * a.pq[(xr * nsb + i) * 8 + v];
          macc = std::fma(half_to_float(blk + 2) * dk, static_cast<float>(msum), macc);
        }
      }
      j.y[r * j.ldy + n] = QT == Q6_K ? hsum8(acc) : hsum8(acc) - macc;
    }
  }
}

// ---------------------------------------------------------------- AVX2
#define K8_AVX2 __attribute__((target("avx2,fma,f16c")))

K8_AVX2 inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// the shuffle that fills every int16 of a 128-bit lane with its element e
K8_AVX2 inline __m256i pick16(int e) { return _mm256_set1_epi16(static_cast<int16_t>((2 * e) | ((2 * e + 1) << 8))); }

// Q4_K / Q5_K: R rows of x against weight rows [n0, n1)
template <int QT, int R>
K8_AVX2 void rows_q45k(const Job8& j, int r0, int64_t n0, int64_t n1) {
  constexpr int64_t BB = kbytes<QT>();
  const int64_t nsb = j.k / QK_K;
  const Act8& a = *j.a;
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  const int64_t xr0 = j.r0 + r0;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    __m256 acc[R];
    float macc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), macc[r] = 0.f;
    for (int64_t i = 0; i < nsb; ++i) {
      const uint8_t* blk = row + i * BB;
      prefetch_span(blk, BB);
      uint8_t s8[8], m8[8];
      scales_mins_k4(blk + 4, s8, m8);
      int64_t sv, mv;
      std::memcpy(&sv, s8, 8), std::memcpy(&mv, m8, 8);
      const __m128i sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(sv));
      const __m256i mn32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mv));
      __m256i scale[R], sumi[R];
      int32_t msum[R];
      for (int r = 0; r < R; ++r) {
        const int64_t sb = (xr0 + r) * nsb + i;
        const __m128i p8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.p.data() + sb * 8));
        scale[r] = _mm256_broadcastsi128_si256(_mm_mullo_epi16(sc16, p8));
        msum[r] = hsum_epi32(_mm256_mullo_epi32(mn32, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                          a.pq.data() + sb * 8))));
        sumi[r] = _mm256_setzero_si256();
      }
      const __m256i qh = QT == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16))
                                    : _mm256_setzero_si256();
      const uint8_t* qp = blk + (QT == Q4_K ? 16 : 48);
      for (int c = 0; c < 4; ++c) {  // 64 values: sub-block 2c in the low nibbles, 2c + 1 in the high
        const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + 32 * c));
        __m256i lo = _mm256_and_si256(wb, m4), hi = _mm256_and_si256(_mm256_srli_epi16(wb, 4), m4);
        if (QT == Q5_K) {
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
        }
        const __m256i plo = pick16(2 * c), phi = pick16(2 * c + 1);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = a.qs.data() + (xr0 + r) * j.k + i * QK_K + 64 * c;
          const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
          const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
          const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_shuffle_epi8(scale[r], plo));
          const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), _mm256_shuffle_epi8(scale[r], phi));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
        }
      }
      const float dw = half_f16c(blk), dmin = half_f16c(blk + 2);
      for (int r = 0; r < R; ++r) {
        const float dk = a.dk[(xr0 + r) * nsb + i];
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dk), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        macc[r] = std::fma(dmin * dk, static_cast<float>(msum[r]), macc[r]);
      }
    }
    for (int r = 0; r < R; ++r) j.y[(r0 + r) * j.ldy + n] = hsum256(acc[r]) - macc[r];
  }
}

// Q6_K: R rows of x against weight rows [n0, n1), as llama.cpp's ggml_vec_dot_q6_K_q8_K: the unsigned q (0..63) times
// x in vpmaddubsw (a pair at most 2 * 63 * 127, no saturation), less 32 (x_2i + x_2i+1), the x row's pair sums made
// once a call (pair_sums32), so each int16 pair is (q - 32) x exactly and the int32 lanes are those of the sign trick
// on q - 32 that this replaced (|w| and sign(x, w): two operations more per weight vector and one per x row).

// 32 (x_2i + x_2i+1) for rows j.r0 .. j.r0 + j.m of the call, k / 2 int16 a row
K8_AVX2 void pair_sums32(const Job8& j, std::vector<int16_t>& out) {
  const __m256i m32 = _mm256_set1_epi8(32);
  out.resize(static_cast<size_t>(j.m) * j.k / 2);
  for (int r = 0; r < j.m; ++r) {
    const int8_t* x = j.a->qs.data() + (j.r0 + r) * j.k;
    int16_t* o = out.data() + static_cast<int64_t>(r) * j.k / 2;
    for (int64_t t = 0; t < j.k; t += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + t / 2),
                          _mm256_maddubs_epi16(m32, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + t))));
  }
}

template <int R>
K8_AVX2 void rows_q6k(const Job8& j, const int16_t* x32s, int r0, int64_t n0, int64_t n1) {
  const int64_t nsb = j.k / QK_K;
  const Act8& a = *j.a;
  const int64_t xr0 = j.r0 + r0;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; ++i) {
      const uint8_t* blk = row + i * 210;
      prefetch_span(blk, 210);
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      __m256i lo8[R], hi8[R], sumi[R];  // S_g for g < 8 in both lanes, likewise g >= 8
      for (int r = 0; r < R; ++r) {
        const __m128i p8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.p.data() + ((xr0 + r) * nsb + i) * 8));
        const __m256i p16 = _mm256_set_m128i(_mm_unpackhi_epi16(p8, p8), _mm_unpacklo_epi16(p8, p8));
        const __m256i s = _mm256_mullo_epi16(sc16, p16);
        lo8[r] = _mm256_permute2x128_si256(s, s, 0x00), hi8[r] = _mm256_permute2x128_si256(s, s, 0x11);
        sumi[r] = _mm256_setzero_si256();
      }
      for (int h = 0; h < 2; ++h) {
        __m256i q[4];
        q6_quarters(blk + 64 * h, blk + 128 + 32 * h, q);
        for (int c = 0; c < 4; ++c) {  // sub-block v = 4h + c: groups 2v (values 0-15) and 2v + 1 (16-31)
          const __m256i pick = _mm256_set_m128i(_mm256_castsi256_si128(pick16(2 * c + 1)),
                                                _mm256_castsi256_si128(pick16(2 * c)));
          const int64_t at = i * QK_K + 128 * h + 32 * c;
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs.data() + (xr0 + r) * j.k + at));
            const __m256i x32 =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x32s + (r0 + r) * j.k / 2 + at / 2));
            const __m256i pr = _mm256_sub_epi16(_mm256_maddubs_epi16(q[c], xv), x32);
            const __m256i s = _mm256_shuffle_epi8(h ? hi8[r] : lo8[r], pick);
            sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(pr, s));
          }
        }
      }
      const float dw = half_f16c(blk + 208);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.dk[(xr0 + r) * nsb + i]), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    for (int r = 0; r < R; ++r) j.y[(r0 + r) * j.ldy + n] = hsum256(acc[r]);
  }
}

using Rows8 = void (*)(const Job8&, int, int64_t, int64_t);
using Rows6 = void (*)(const Job8&, const int16_t*, int, int64_t, int64_t);  // Q6_K: with the call's pair sums

template <typename Fn, typename... Extra>
void tiles(const Job8& j, int64_t n0, int64_t n1, const Fn (&fns)[4], Extra... extra) {
  for (int64_t t0 = n0; t0 < n1; t0 += 16) {  // 16 weight rows stay in L1 while every group of 4 x rows passes
    const int64_t t1 = t0 + 16 < n1 ? t0 + 16 : n1;
    for (int r0 = 0; r0 < j.m; r0 += 4) fns[(j.m - r0 < 4 ? j.m - r0 : 4) - 1](j, extra..., r0, t0, t1);
  }
}

}  // namespace

void supers8_rows(const Job8& j, int64_t n0, int64_t n1, int p) {
  static constexpr Rows8 Q4K[4] = {rows_q45k<Q4_K, 1>, rows_q45k<Q4_K, 2>, rows_q45k<Q4_K, 3>, rows_q45k<Q4_K, 4>};
  static constexpr Rows8 Q5K[4] = {rows_q45k<Q5_K, 1>, rows_q45k<Q5_K, 2>, rows_q45k<Q5_K, 3>, rows_q45k<Q5_K, 4>};
  static constexpr Rows6 Q6K[4] = {rows_q6k<1>, rows_q6k<2>, rows_q6k<3>, rows_q6k<4>};
  const bool vec = p >= PATH_AVX2;
  switch (j.qtype) {
    case Q4_K: return vec ? tiles(j, n0, n1, Q4K) : rows_scalar<Q4_K>(j, n0, n1);
    case Q5_K: return vec ? tiles(j, n0, n1, Q5K) : rows_scalar<Q5_K>(j, n0, n1);
    case Q6_K: {
      if (!vec) return rows_scalar<Q6_K>(j, n0, n1);
      thread_local std::vector<int16_t> x32;  // the call's x pair sums, made once for all its weight rows
      pair_sums32(j, x32);
      return tiles(j, n0, n1, Q6K, static_cast<const int16_t*>(x32.data()));
    }
    default: TORCH_CHECK(false, "no int8 kernel for ggml type ", j.qtype, " among the K-quants");
  }
}

}  // namespace wq
