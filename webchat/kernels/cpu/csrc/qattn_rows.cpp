// Decode and verify rows' attention (qattn.h): one token's query rows for the query heads of one kv head, against
// the n keys (values) of a page where they lie in the pool, row i at kp + i * st.
//
// Arithmetic, per head, in this order on each path (a head's numbers are its own, whatever heads share the call):
//   s_i = scale * (q . k_i): the head's products in vectors of 8 (AVX2) or 16 (AVX-512) lanes, fma down the head,
//     the lanes summed as hadd does (AVX-512: each vector's 8-lane halves added first); the scalar path in index order
//   o += sum_i w_i v_i: fma per key in key order (AVX-512: even and odd keys in two sets of sums, added at the end)
// At 16 lanes the grouped kernels take a kv head's query heads G at a time, each key (value) vector loaded once for
// them, each head's operations the one-head kernel's: the same bits (tests/kernels/test_cpu_step.py splits units a
// head each).
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "qattn.h"
#include "qcommon.h"

namespace wq {

namespace {

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

AVX2_FN float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float r = hsum256(acc);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

AVX2_FN void axpy_avx2(float* y, float a, const float* x, int64_t n) {  // y += a * x
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

float dot_scalar(const float* a, const float* b, int64_t n) {
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += a[i] * b[i];
  return r;
}

void axpy_scalar(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Attention kernels for one query head, hd = 8 * NV. k/v of the n keys of a page sit kvd floats apart.
// s[i] = scale * q . k_i, four keys at a time (four independent FMA chains, reduced together)
template <int NV>
AVX2_FN void score_keys_avx2(const float* q, const float* kp, int64_t kvd, int64_t n, float scale, float* s) {
  __m256 qv[NV];
  #pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  const __m128 vscale = _mm_set1_ps(scale);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float* k0 = kp + i * kvd;
    __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0));
    __m256 a1 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0 + kvd));
    __m256 a2 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0 + 2 * kvd));
    __m256 a3 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0 + 3 * kvd));
    #pragma GCC unroll 16
    for (int c = 1; c < NV; ++c) {
      a0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 8 * c), a0);
      a1 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + kvd + 8 * c), a1);
      a2 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 2 * kvd + 8 * c), a2);
      a3 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 3 * kvd + 8 * c), a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(s + i, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), vscale));
  }
  for (; i < n; ++i) {
    const float* k0 = kp + i * kvd;
    __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0));
    #pragma GCC unroll 16
    for (int c = 1; c < NV; ++c) a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 8 * c), a);
    s[i] = hsum256(a) * scale;
  }
}

// o += sum_i w[i] v_i, with o held in NV registers across the page
template <int NV>
AVX2_FN void accumulate_avx2(float* o, const float* w, const float* vp, int64_t kvd, int64_t n) {
  __m256 ov[NV];
  #pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) ov[c] = _mm256_loadu_ps(o + 8 * c);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 bw = _mm256_broadcast_ss(w + i);
    #pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) ov[c] = _mm256_fmadd_ps(bw, _mm256_loadu_ps(vp + i * kvd + 8 * c), ov[c]);
  }
  #pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(o + 8 * c, ov[c]);
}

// The same two kernels at 16 lanes (hd = 16 * NV): scores four keys at a time, each key's zmm halves added before
// the AVX2 reduction; o += w v over two interleaved sets of accumulators (even and odd keys, added at the end), so
// the FMA chains are not one key's latency apart.
#define AVX512_FN __attribute__((target("avx512f,avx2,fma,f16c")))
AVX512_FN inline __m256 halves(__m512 a) {  // the two 8-lane halves added
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

template <int NV>
AVX512_FN void score_keys_avx512(const float* q, const float* kp, int64_t kvd, int64_t n, float scale, float* s) {
  __m512 qv[NV];
  #pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  const __m128 vscale = _mm_set1_ps(scale);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float* k0 = kp + i * kvd;
    __m512 a0 = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k0));
    __m512 a1 = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k0 + kvd));
    __m512 a2 = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k0 + 2 * kvd));
    __m512 a3 = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k0 + 3 * kvd));
    #pragma GCC unroll 16
    for (int c = 1; c < NV; ++c) {
      a0 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k0 + 16 * c), a0);
      a1 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k0 + kvd + 16 * c), a1);
      a2 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k0 + 2 * kvd + 16 * c), a2);
      a3 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k0 + 3 * kvd + 16 * c), a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves(a0), halves(a1)), _mm256_hadd_ps(halves(a2), halves(a3)));
    _mm_storeu_ps(s + i, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), vscale));
  }
  for (; i < n; ++i) {
    const float* k0 = kp + i * kvd;
    __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k0));
    #pragma GCC unroll 16
    for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k0 + 16 * c), a);
    s[i] = hsum256(halves(a)) * scale;
  }
}

template <int NV>
AVX512_FN void accumulate_avx512(float* o, const float* w, const float* vp, int64_t kvd, int64_t n) {
  __m512 ov[NV], ow[NV];
  #pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) ov[c] = _mm512_loadu_ps(o + 16 * c), ow[c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    const __m512 b0 = _mm512_set1_ps(w[i]), b1 = _mm512_set1_ps(w[i + 1]);
    #pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      ov[c] = _mm512_fmadd_ps(b0, _mm512_loadu_ps(vp + i * kvd + 16 * c), ov[c]);
      ow[c] = _mm512_fmadd_ps(b1, _mm512_loadu_ps(vp + (i + 1) * kvd + 16 * c), ow[c]);
    }
  }
  if (i < n) {
    const __m512 b0 = _mm512_set1_ps(w[i]);
    #pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) ov[c] = _mm512_fmadd_ps(b0, _mm512_loadu_ps(vp + i * kvd + 16 * c), ov[c]);
  }
  #pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_add_ps(ov[c], ow[c]));
}

// The two 16-lane kernels for G query heads of one kv head at once (q: G rows hd apart; s[h], o[h], w[h]: head h's):
// each key's (or value's) vectors are loaded once for the G heads instead of once a head, so a page is read in one
// pass. Each head's arithmetic is the one-head kernel's, in its order: the same bits.
template <int NV, int G>
AVX512_FN void score_keys_group(const float* q, const float* kp, int64_t kvd, int64_t n, float scale,
                                       float* const* s) {
  constexpr int HD = 16 * NV;
  const __m128 vscale = _mm_set1_ps(scale);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float* k0 = kp + i * kvd;
    __m512 a[G][4];
    #pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m512 kv0 = _mm512_loadu_ps(k0 + t * kvd);
      #pragma GCC unroll 4
      for (int h = 0; h < G; ++h) a[h][t] = _mm512_mul_ps(_mm512_loadu_ps(q + h * HD), kv0);
    }
    #pragma GCC unroll 16
    for (int c = 1; c < NV; ++c)
      #pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m512 kvc = _mm512_loadu_ps(k0 + t * kvd + 16 * c);
        #pragma GCC unroll 4
        for (int h = 0; h < G; ++h) a[h][t] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * HD + 16 * c), kvc, a[h][t]);
      }
    #pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      const __m256 r = _mm256_hadd_ps(_mm256_hadd_ps(halves(a[h][0]), halves(a[h][1])),
                                      _mm256_hadd_ps(halves(a[h][2]), halves(a[h][3])));
      _mm_storeu_ps(s[h] + i, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1)), vscale));
    }
  }
  for (; i < n; ++i) {
    const float* k0 = kp + i * kvd;
    #pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + h * HD), _mm512_loadu_ps(k0));
      #pragma GCC unroll 16
      for (int c = 1; c < NV; ++c)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * HD + 16 * c), _mm512_loadu_ps(k0 + 16 * c), a);
      s[h][i] = hsum256(halves(a)) * scale;
    }
  }
}

template <int NV, int G>
AVX512_FN void accumulate_group(float* const* o, const float* const* w, const float* vp, int64_t kvd,
                                       int64_t n) {
  __m512 ov[G][NV], ow[G][NV];
  #pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
    #pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) ov[h][c] = _mm512_loadu_ps(o[h] + 16 * c), ow[h][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    #pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      const __m512 v0 = _mm512_loadu_ps(vp + i * kvd + 16 * c), v1 = _mm512_loadu_ps(vp + (i + 1) * kvd + 16 * c);
      #pragma GCC unroll 4
      for (int h = 0; h < G; ++h) {
        ov[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[h][i]), v0, ov[h][c]);
        ow[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[h][i + 1]), v1, ow[h][c]);
      }
    }
  }
  if (i < n) {
    #pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      const __m512 v0 = _mm512_loadu_ps(vp + i * kvd + 16 * c);
      #pragma GCC unroll 4
      for (int h = 0; h < G; ++h) ov[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[h][i]), v0, ov[h][c]);
    }
  }
  #pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
    #pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o[h] + 16 * c, _mm512_add_ps(ov[h][c], ow[h][c]));
}

// heads [0, heads), G at a time, the last 2 or 1 as a smaller group
template <int G, typename Run>
void by_groups(int64_t heads, Run&& run) {
  int64_t h = 0;
  for (; h + G <= heads; h += G) run(h, std::integral_constant<int, G>{});
  if (G == 3 && heads - h == 2) run(h, std::integral_constant<int, 2>{});
  if (heads - h == 1) run(h, std::integral_constant<int, 1>{});
}

// hd = 8 * NV8. At 16 lanes several heads G at a time (3 at hd 64, 2 at 128: what 32 registers hold) and a lone head
// through the one-head kernel; at 8 lanes a head at a time (a kv group's heads 2 at a time, each key loaded once for
// them, decoded no faster on Zen 4's AVX2 path 7,472 tokens deep: 57-63 tok/s either way)
template <int NV8>
void scores_of(bool wide, const float* q, int64_t heads, const float* kp, int64_t st, int64_t n, float scale,
               float* const* s) {
  constexpr int NV16 = NV8 / 2, HD = 8 * NV8;
  if (!wide)
    for (int64_t h = 0; h < heads; ++h) score_keys_avx2<NV8>(q + h * HD, kp, st, n, scale, s[h]);
  else if (heads == 1)
    score_keys_avx512<NV16>(q, kp, st, n, scale, s[0]);
  else
    by_groups<NV16 == 4 ? 3 : 2>(heads, [&](int64_t h, auto g) {
      score_keys_group<NV16, decltype(g)::value>(q + h * HD, kp, st, n, scale, s + h);
    });
}

template <int NV8>
void values_of(bool wide, float* const* o, const float* const* w, int64_t heads, const float* vp, int64_t st,
               int64_t n) {
  constexpr int NV16 = NV8 / 2;
  if (!wide)
    for (int64_t h = 0; h < heads; ++h) accumulate_avx2<NV8>(o[h], w[h], vp, st, n);
  else if (heads == 1)
    accumulate_avx512<NV16>(o[0], w[0], vp, st, n);
  else
    by_groups<NV16 == 4 ? 3 : 2>(heads, [&](int64_t h, auto g) {
      accumulate_group<NV16, decltype(g)::value>(o + h, w + h, vp, st, n);
    });
}

}  // namespace

void row_scores(int path, const float* q, int64_t heads, int64_t hd, const float* kp, int64_t st, int64_t n,
                float scale, float* const* s) {
  if (n <= 0) return;
  const bool wide = path == PATH_AVX512, vec = path >= PATH_AVX2;
  if (vec && hd == 64) return scores_of<8>(wide, q, heads, kp, st, n, scale, s);
  if (vec && hd == 128) return scores_of<16>(wide, q, heads, kp, st, n, scale, s);
  for (int64_t h = 0; h < heads; ++h)  // other head sizes
    for (int64_t i = 0; i < n; ++i)
      s[h][i] = (vec ? dot_avx2(q + h * hd, kp + i * st, hd) : dot_scalar(q + h * hd, kp + i * st, hd)) * scale;
}

void row_values(int path, float* const* o, const float* const* w, int64_t heads, int64_t hd, const float* vp,
                int64_t st, int64_t n) {
  if (n <= 0) return;
  const bool wide = path == PATH_AVX512, vec = path >= PATH_AVX2;
  if (vec && hd == 64) return values_of<8>(wide, o, w, heads, vp, st, n);
  if (vec && hd == 128) return values_of<16>(wide, o, w, heads, vp, st, n);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < n; ++i)
      vec ? axpy_avx2(o[h], w[h][i], vp + i * st, hd) : axpy_scalar(o[h], w[h][i], vp + i * st, hd);
}

}  // namespace wq
