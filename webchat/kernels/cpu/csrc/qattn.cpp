// A prompt's attention as tiles (qattn.h): the query rows of a unit side by side in vector lanes, so the scores are a
// GEMM's product with no horizontal sum, and the softmax and the sums of p v run down the keys with a lane per row.
//
// Arithmetic, every path in this order (the scalar one with std::fma; lanes never meet, so a row's numbers are its own
// whatever shares its tile):
//   s_i = (q_0 k_i,0, then fma(q_d, k_i,d, s) for d = 1 .. hd - 1) * scale;  cap: c tanh(s / c)
//   m = the largest s_i of the row's keys; p_i = exp(s_i - m) (0 outside the row's keys); l = sum_i p_i in key order
//   o_c = sum_i p_i v_i,c in key order (fma from 0)
// The vector paths give each other's bits (the same chains; exp256 or exp512, the same operations, for the vector paths,
// std::exp for the scalar one).
#include "qattn.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "qcommon.h"

namespace wq {

namespace {

#define T_AVX2 __attribute__((target("avx2,fma")))
#define T_AVX512 __attribute__((target("avx512f,avx2,fma")))

// ---------------------------------------------------------------- scores: S[i][lane] for KG keys, V vectors of lanes
template <int V, int KG>
T_AVX512 inline void scores_512(const float* qt, int64_t L, int64_t hd, const float* k, int64_t st, float scale,
                                float* S) {
  __m512 acc[KG][V];
  #pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    const __m512 q0 = _mm512_loadu_ps(qt + 16 * v);
    #pragma GCC unroll 8
    for (int g = 0; g < KG; ++g) acc[g][v] = _mm512_mul_ps(q0, _mm512_set1_ps(k[g * st]));
  }
  for (int64_t d = 1; d < hd; ++d) {
    __m512 qv[V];
    #pragma GCC unroll 8
    for (int v = 0; v < V; ++v) qv[v] = _mm512_loadu_ps(qt + d * L + 16 * v);
    #pragma GCC unroll 8
    for (int g = 0; g < KG; ++g) {
      const __m512 kb = _mm512_set1_ps(k[g * st + d]);
      #pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(qv[v], kb, acc[g][v]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  #pragma GCC unroll 8
  for (int g = 0; g < KG; ++g)
    #pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(S + g * L + 16 * v, _mm512_mul_ps(acc[g][v], sc));
}

template <int V, int KG>
T_AVX2 inline void scores_256(const float* qt, int64_t L, int64_t hd, const float* k, int64_t st, float scale,
                              float* S) {
  __m256 acc[KG][V];
  #pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    const __m256 q0 = _mm256_loadu_ps(qt + 8 * v);
    #pragma GCC unroll 8
    for (int g = 0; g < KG; ++g) acc[g][v] = _mm256_mul_ps(q0, _mm256_set1_ps(k[g * st]));
  }
  for (int64_t d = 1; d < hd; ++d) {
    __m256 qv[V];
    #pragma GCC unroll 8
    for (int v = 0; v < V; ++v) qv[v] = _mm256_loadu_ps(qt + d * L + 8 * v);
    #pragma GCC unroll 8
    for (int g = 0; g < KG; ++g) {
      const __m256 kb = _mm256_broadcast_ss(k + g * st + d);
      #pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[g][v] = _mm256_fmadd_ps(qv[v], kb, acc[g][v]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  #pragma GCC unroll 8
  for (int g = 0; g < KG; ++g)
    #pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(S + g * L + 8 * v, _mm256_mul_ps(acc[g][v], sc));
}

void scores_scalar(const float* qt, int64_t L, int64_t hd, const float* k, float scale, float* S) {
  for (int64_t r = 0; r < L; ++r) {
    float s = qt[r] * k[0];
    for (int64_t d = 1; d < hd; ++d) s = std::fma(qt[d * L + r], k[d], s);
    S[r] = s * scale;
  }
}

// every lane block of one key group: 3 vectors of lanes on AVX-512 (48 lanes: 24 sums and each key's broadcast
// read once for three FMAs), then 2 or 1; on AVX2 2 (16 lanes) and a last block of one
template <int KG>
T_AVX512 void keys_512(const float* qt, int64_t L, int64_t hd, const float* k, int64_t st, float scale, float* S) {
  int64_t r = 0;
  for (; r + 48 <= L; r += 48) scores_512<3, KG>(qt + r, L, hd, k, st, scale, S + r);
  if (r + 32 <= L) scores_512<2, KG>(qt + r, L, hd, k, st, scale, S + r), r += 32;
  if (r < L) scores_512<1, KG>(qt + r, L, hd, k, st, scale, S + r);
}

template <int KG>
T_AVX2 void keys_256(const float* qt, int64_t L, int64_t hd, const float* k, int64_t st, float scale, float* S) {
  int64_t r = 0;
  for (; r + 16 <= L; r += 16) scores_256<2, KG>(qt + r, L, hd, k, st, scale, S + r);
  if (r < L) scores_256<1, KG>(qt + r, L, hd, k, st, scale, S + r);
}

// ---------------------------------------------------------------- p v, R lanes at a time, hd = 16 NV (8 NV)
// over np pages' values in key order (page q's n[q] rows at vp[q], st apart; S's key rows run on across them), the
// sums kept in registers from the first page to the last
template <int R, int NV>
T_AVX512 inline void pv_512(const float* S, int64_t L, int np, const float* const* vp, const int64_t* n, int64_t st,
                            float* const* out) {
  __m512 acc[R][NV];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(out[r] + 16 * c);
  for (int q = 0; q < np; S += n[q] * L, ++q)
    for (int64_t i = 0; i < n[q]; ++i) {
      __m512 v[NV];
      #pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_ps(vp[q] + i * st + 16 * c);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 p = _mm512_set1_ps(S[i * L + r]);
        #pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(p, v[c], acc[r][c]);
      }
    }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out[r] + 16 * c, acc[r][c]);
}

// AVX2: 8 columns (64 values) of one lane a pass, the values read from memory by the FMAs
T_AVX2 inline void pv_256(const float* S, int64_t L, int np, const float* const* vp, const int64_t* n, int64_t st,
                          int64_t col, float* o) {
  __m256 acc[8];
  #pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(o + 8 * c);
  for (int q = 0; q < np; S += n[q] * L, ++q)
    for (int64_t i = 0; i < n[q]; ++i) {
      const __m256 p = _mm256_broadcast_ss(S + i * L);
      const float* v = vp[q] + i * st + col;
      #pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
    }
  #pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
}

// the lanes whose keys [lo, hi) include position pos
T_AVX2 inline __m256 inside(__m256i lo, __m256i hi, int64_t pos) {
  const __m256i p = _mm256_set1_epi32(static_cast<int32_t>(pos));
  return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(lo, p), _mm256_cmpgt_epi32(hi, p)));
}

// the softmax numerators of 8 lanes down the keys: -inf outside [lo, hi), m their largest, p = exp(s - m), l = sum p
T_AVX2 void softmax_256(float* S, int64_t L, int64_t n, int64_t key0, const int32_t* lo, const int32_t* hi, float* m,
                        float* l) {
  const __m256i vlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
  const __m256i vhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi));
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  // keys [a, b) are every lane's (no mask there): most of them, where the lanes are one chunk's rows
  int32_t most_lo = lo[0], least_hi = hi[0];
  for (int r = 1; r < 8; ++r) most_lo = std::max(most_lo, lo[r]), least_hi = std::min(least_hi, hi[r]);
  const int64_t a = std::clamp<int64_t>(most_lo - key0, 0, n), b = std::clamp<int64_t>(least_hi - key0, a, n);
  __m256 mx = ninf;
  for (int64_t i = 0; i < a; ++i)
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(S + i * L), inside(vlo, vhi, key0 + i)));
  for (int64_t i = a; i < b; ++i) mx = _mm256_max_ps(mx, _mm256_loadu_ps(S + i * L));
  for (int64_t i = b; i < n; ++i)
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(S + i * L), inside(vlo, vhi, key0 + i)));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(S + i * L), mx));
    if (i < a || i >= b) p = _mm256_and_ps(p, inside(vlo, vhi, key0 + i));
    _mm256_storeu_ps(S + i * L, p);
    sum = _mm256_add_ps(sum, p);
  }
  _mm256_storeu_ps(m, mx);
  _mm256_storeu_ps(l, sum);
}

T_AVX512 inline __mmask16 inside16(__m512i lo, __m512i hi, int64_t pos) {
  const __m512i p = _mm512_set1_epi32(static_cast<int32_t>(pos));
  return static_cast<__mmask16>(_mm512_cmple_epi32_mask(lo, p) & _mm512_cmpgt_epi32_mask(hi, p));
}

// softmax_256 on 16 lanes (the same operations lane by lane, so the same bits)
T_AVX512 void softmax_512(float* S, int64_t L, int64_t n, int64_t key0, const int32_t* lo, const int32_t* hi, float* m,
                          float* l) {
  const __m512i vlo = _mm512_loadu_si512(lo), vhi = _mm512_loadu_si512(hi);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int32_t most_lo = lo[0], least_hi = hi[0];
  for (int r = 1; r < 16; ++r) most_lo = std::max(most_lo, lo[r]), least_hi = std::min(least_hi, hi[r]);
  const int64_t a = std::clamp<int64_t>(most_lo - key0, 0, n), b = std::clamp<int64_t>(least_hi - key0, a, n);
  __m512 mx = ninf;
  for (int64_t i = 0; i < a; ++i)
    mx = _mm512_max_ps(mx, _mm512_mask_blend_ps(inside16(vlo, vhi, key0 + i), ninf, _mm512_loadu_ps(S + i * L)));
  for (int64_t i = a; i < b; ++i) mx = _mm512_max_ps(mx, _mm512_loadu_ps(S + i * L));
  for (int64_t i = b; i < n; ++i)
    mx = _mm512_max_ps(mx, _mm512_mask_blend_ps(inside16(vlo, vhi, key0 + i), ninf, _mm512_loadu_ps(S + i * L)));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(S + i * L), mx));
    if (i < a || i >= b) p = _mm512_maskz_mov_ps(inside16(vlo, vhi, key0 + i), p);
    _mm512_storeu_ps(S + i * L, p);
    sum = _mm512_add_ps(sum, p);
  }
  _mm512_storeu_ps(m, mx);
  _mm512_storeu_ps(l, sum);
}

}  // namespace

void prefetch_rows(const float* x, int64_t st, int64_t n, int64_t hd) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < hd; c += 16) _mm_prefetch(reinterpret_cast<const char*>(x + i * st + c), _MM_HINT_T0);
}

void tile_scores(int p, const float* qt, int64_t L, int64_t hd, const float* k, int64_t st, int64_t n, float scale,
                 float* S) {
  int64_t i = 0;  // keys in groups of 8 (AVX2 4), then 4, 2, 1: a page of 16 is whole groups; on AVX2 the next
                  // group's rows asked for while one group's chains run (AVX-512's 48 lanes leave the hardware's
                  // prefetchers time enough: asking there cost 2% of a deep prompt)
  if (p == PATH_AVX512) {
    for (; i + 8 <= n; i += 8) keys_512<8>(qt, L, hd, k + i * st, st, scale, S + i * L);
    for (; i + 4 <= n; i += 4) keys_512<4>(qt, L, hd, k + i * st, st, scale, S + i * L);
    for (; i + 2 <= n; i += 2) keys_512<2>(qt, L, hd, k + i * st, st, scale, S + i * L);
    for (; i < n; ++i) keys_512<1>(qt, L, hd, k + i * st, st, scale, S + i * L);
  } else if (p == PATH_AVX2) {
    for (; i + 4 <= n; i += 4) {
      prefetch_rows(k + (i + 4) * st, st, std::min<int64_t>(4, n - i - 4), hd);
      keys_256<4>(qt, L, hd, k + i * st, st, scale, S + i * L);
    }
    for (; i + 2 <= n; i += 2) keys_256<2>(qt, L, hd, k + i * st, st, scale, S + i * L);
    for (; i < n; ++i) keys_256<1>(qt, L, hd, k + i * st, st, scale, S + i * L);
  } else {
    for (; i < n; ++i) scores_scalar(qt, L, hd, k + i * st, scale, S + i * L);
  }
}

void tile_softmax(int p, float* S, int64_t L, int64_t n, int64_t key0, const int32_t* lo, const int32_t* hi, float cap,
                  float* m, float* l) {
  if (cap > 0.f)
    for (int64_t x = 0; x < n * L; ++x) S[x] = std::tanh(S[x] / cap) * cap;
  if (p == PATH_AVX512) {  // L is whole vectors of 16 lanes
    for (int64_t r = 0; r < L; r += 16) softmax_512(S + r, L, n, key0, lo + r, hi + r, m + r, l + r);
    return;
  }
  if (p >= PATH_AVX2) {
    for (int64_t r = 0; r < L; r += 8) softmax_256(S + r, L, n, key0, lo + r, hi + r, m + r, l + r);
    return;
  }
  for (int64_t r = 0; r < L; ++r) {
    float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t i = 0; i < n; ++i)
      if (key0 + i >= lo[r] && key0 + i < hi[r]) mx = std::max(mx, S[i * L + r]);
    for (int64_t i = 0; i < n; ++i) {
      float& s = S[i * L + r];
      s = key0 + i >= lo[r] && key0 + i < hi[r] ? std::exp(s - mx) : 0.f;
      sum += s;
    }
    m[r] = mx, l[r] = sum;
  }
}

void tile_values(int p, const float* S, int64_t L, int64_t rows, int np, const float* const* vp, const int64_t* n,
                 int64_t st, int64_t hd, float* const* out) {
  int64_t r = 0;
  if (p == PATH_AVX512 && hd == 64) {  // 6 lanes a pass: 24 sums, 4 values and a p in the 32 registers
    for (; r + 6 <= rows; r += 6) pv_512<6, 4>(S + r, L, np, vp, n, st, out + r);
    for (; r + 4 <= rows; r += 4) pv_512<4, 4>(S + r, L, np, vp, n, st, out + r);
    for (; r < rows; ++r) pv_512<1, 4>(S + r, L, np, vp, n, st, out + r);
  } else if (p == PATH_AVX512 && hd == 128) {
    for (; r + 2 <= rows; r += 2) pv_512<2, 8>(S + r, L, np, vp, n, st, out + r);
    for (; r < rows; ++r) pv_512<1, 8>(S + r, L, np, vp, n, st, out + r);
  } else if (p >= PATH_AVX2 && hd % 64 == 0) {
    for (; r < rows; ++r)
      for (int64_t c = 0; c < hd; c += 64) pv_256(S + r, L, np, vp, n, st, c, out[r] + c);
  }
  for (; r < rows; ++r) {
    const float* s = S + r;
    for (int q = 0; q < np; s += n[q] * L, ++q)
      for (int64_t i = 0; i < n[q]; ++i)
        for (int64_t c = 0; c < hd; ++c) out[r][c] = std::fma(s[i * L], vp[q][i * st + c], out[r][c]);
  }
}

}  // namespace wq
