// Activations quantized to 8 bits (Act8, qint8.h) and the int8 matmul's threading (qmatmul8_multi).
//
// The scalar and AVX2 quantizers give the same bytes: max |x| is exact in any order, the scale 127 / a one division,
// each x times it one multiplication (times 2^e first for the super-blocks: exact), rounded half to even
// (std::nearbyint in the default rounding mode, as _mm256_cvtps_epi32 rounds). |x| <= a makes |q| <= 127.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qint8.h"

namespace wq {

namespace {

constexpr int EMAX = 7;  // a sub-block 2^7 times smaller than its super-block's largest keeps 7 more bits, no more
// the row kernels' calls of more than CHUNK_BYTES of weights a thread: in chunks of at least CHUNK_BYTES, at most
// CHUNKS_A_THREAD a thread (qmatmul8_multi)
constexpr int64_t CHUNKS_A_THREAD = 16, CHUNK_BYTES = int64_t(256) << 10;

// ---------------------------------------------------------------- scalar
float amax_scalar(const float* x, int n) {
  float a = 0.f;
  for (int i = 0; i < n; ++i) a = std::max(a, std::fabs(x[i]));
  return a;
}

// q = round(x * scale * id) for n values; returns sum(q)
int32_t round_scalar(const float* x, int n, float scale, float id, int8_t* q) {
  int32_t sum = 0;
  for (int i = 0; i < n; ++i) {
    const int v = static_cast<int>(std::nearbyint((x[i] * scale) * id));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  return sum;
}

// ---------------------------------------------------------------- AVX2: 32 values at a time
#define QA_AVX2 __attribute__((target("avx2,fma,f16c")))

QA_AVX2 inline float amax32_avx2(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
  a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8)));
  a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 16)));
  a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 24)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

QA_AVX2 inline int32_t round32_avx2(const float* x, float scale, float id, int8_t* q) {
  const __m256 vs = _mm256_set1_ps(scale), vi = _mm256_set1_ps(id);
  __m256i i[4];
  for (int c = 0; c < 4; ++c) i[c] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * c), vs), vi));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  // int32 -> int16 -> int8 packs work per 128-bit half: (0-3, 8-11, 16-19, 24-27 | 4-7, ...), put back in order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

using Amax = float (*)(const float*);
using Round = int32_t (*)(const float*, float, float, int8_t*);
float amax32_scalar(const float* x) { return amax_scalar(x, 32); }
int32_t round32_scalar(const float* x, float scale, float id, int8_t* q) { return round_scalar(x, 32, scale, id, q); }
float amax8_scalar(const float* x) { return amax_scalar(x, 8); }
int32_t round8_scalar(const float* x, float scale, float id, int8_t* q) { return round_scalar(x, 8, scale, id, q); }

// 8 values at a time
QA_AVX2 inline float amax8_avx2(const float* x) {
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.f), _mm256_loadu_ps(x));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

QA_AVX2 inline int32_t round8_avx2(const float* x, float scale, float id, int8_t* q) {
  const __m256i i = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x), _mm256_set1_ps(scale)),
                                                     _mm256_set1_ps(id)));
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));  // in order
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(w, w));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// one row of k values into the blocks form: a scale per 8 values
void blocks_row(const float* x, int64_t k, int8_t* q, float* d8, float* s, int32_t* c8, Amax amax, Round round) {
  for (int64_t b = 0; b < k / 32; ++b) {
    float part[4];
    for (int c = 0; c < 4; ++c) {
      const float* xc = x + 32 * b + 8 * c;
      const float a = amax(xc);
      const float d = a / 127.f;
      d8[8 * b + 2 * c] = d8[8 * b + 2 * c + 1] = d;
      const int32_t sum = round(xc, 1.f, a > 0.f ? 127.f / a : 0.f, q + 32 * b + 8 * c);
      c8[4 * b + c] = 128 * sum;
      part[c] = d * static_cast<float>(sum);
    }
    s[b] = (part[0] + part[1]) + (part[2] + part[3]);
  }
}

// 8 lanes' maxima of a and b, pairwise: [max(a0, a1), max(a2, a3), max(b0, b1), max(b2, b3) | the same of 4-7]
QA_AVX2 inline __m256 pair_max(__m256 a, __m256 b) {
  return _mm256_max_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// lane g: the sum of v[g]'s 8 lanes (exact int32)
QA_AVX2 inline __m256i lane_sums(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// blocks_row with amax8_avx2 and round8_avx2, two blocks (8 groups) a pass with each group's numbers a lane: the
// maxima, the scales and the integer sums of 8 groups by one vector operation each instead of 8 horizontal
// reductions and 16 scalar divisions. The same bytes and floats (max and integer sums are exact, and every float
// operation is the one blocks_row takes, lane by lane), so its results are blocks_row's. Returns the blocks done (an odd
// row's last is the caller's: blocks_row inlined here, where FMA is enabled, would have its sums contracted).
QA_AVX2 int64_t blocks_row_avx2(const float* x, int64_t k, int8_t* q, float* d8, float* s, int32_t* c8) {
  const int64_t nb = k / 32;
  const __m256 sign = _mm256_set1_ps(-0.f), zero = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const float* xb = x + 32 * b;
    __m256 v[8], a[8];
    for (int g = 0; g < 8; ++g) v[g] = _mm256_loadu_ps(xb + 8 * g), a[g] = _mm256_andnot_ps(sign, v[g]);
    const __m256 m03 = pair_max(pair_max(a[0], a[1]), pair_max(a[2], a[3]));
    const __m256 m47 = pair_max(pair_max(a[4], a[5]), pair_max(a[6], a[7]));
    const __m256 amax = _mm256_max_ps(_mm256_permute2f128_ps(m03, m47, 0x20), _mm256_permute2f128_ps(m03, m47, 0x31));
    const __m256 d = _mm256_div_ps(amax, _mm256_set1_ps(127.f));
    const __m256 id = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(127.f), amax), _mm256_cmp_ps(amax, zero, _CMP_GT_OQ));
    const __m256 dlo = _mm256_unpacklo_ps(d, d), dhi = _mm256_unpackhi_ps(d, d);  // d0 d0 d1 d1 | d4 d4 d5 d5 ...
    _mm256_storeu_ps(d8 + 8 * b, _mm256_permute2f128_ps(dlo, dhi, 0x20));
    _mm256_storeu_ps(d8 + 8 * b + 8, _mm256_permute2f128_ps(dlo, dhi, 0x31));
    __m256i iv[8];
    for (int g = 0; g < 8; ++g) {
      iv[g] = _mm256_cvtps_epi32(_mm256_mul_ps(v[g], _mm256_permutevar8x32_ps(id, _mm256_set1_epi32(g))));
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(iv[g]), _mm256_extracti128_si256(iv[g], 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + 32 * b + 8 * g), _mm_packs_epi16(w, w));
    }
    const __m256i sums8 = lane_sums(iv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c8 + 4 * b), _mm256_slli_epi32(sums8, 7));
    const __m256 part = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sums8));
    const __m256 pairs = _mm256_hadd_ps(part, part);  // (p0 + p1), (p2 + p3), .. | (p4 + p5), (p6 + p7), ..
    const __m256 sums = _mm256_hadd_ps(pairs, pairs);  // (p0 + p1) + (p2 + p3) | (p4 + p5) + (p6 + p7)
    s[b] = _mm256_cvtss_f32(sums);
    s[b + 1] = _mm_cvtss_f32(_mm256_extractf128_ps(sums, 1));
  }
  return b;
}

// ... and into the super-blocks form
void supers_row(const float* x, int64_t k, int8_t* q, float* dk, int16_t* p, int32_t* pq, Amax amax, Round round) {
  for (int64_t i = 0; i < k / 256; ++i) {
    const float* xs = x + 256 * i;
    float a[8], top = 0.f;
    for (int j = 0; j < 8; ++j) top = std::max(top, a[j] = amax(xs + 32 * j));
    const float id = top > 0.f ? 127.f / top : 0.f;
    dk[i] = top / 127.f / 128.f;
    for (int j = 0; j < 8; ++j) {
      int e = 0;
      while (e < EMAX && a[j] * static_cast<float>(2 << e) <= top) ++e;  // a_j 2^(e+1) <= A: one more bit fits
      p[8 * i + j] = static_cast<int16_t>(1 << (EMAX - e));
      pq[8 * i + j] = p[8 * i + j] * round(xs + 32 * j, static_cast<float>(1 << e), id, q + 256 * i + 32 * j);
    }
  }
}

// rows [row0, row0 + m) of a (x: the same rows as floats) against rows [n0, n1) of one matrix, by the row kernels
void rows_of(const Act8& a, int64_t row0, int m, const float* x, const MatRef& mr, int64_t n0, int64_t n1, int p,
             const int32_t* q6t = nullptr) {
  if (mr.qtype == F32) {
    const Job j{x, a.k, nullptr, mr.w, mr.row_bytes, m, a.k, F32, mr.y, mr.n};
    return float_rows(j, n0, n1, p);
  }
  const Job8 j{&a, static_cast<int>(row0), m, mr.w, mr.row_bytes, a.k, mr.qtype, mr.y, mr.n, q6t};
  if (mr.packed) return packed8_rows(j, n0, n1, p);
  reads_supers(mr.qtype) ? supers8_rows(j, n0, n1, p) : blocks8_rows(j, n0, n1, p);
}

// a thread's share [lo, hi) of matrix rows (split anywhere) moved to whole groups of 8 where the matrix is packed:
// every boundary rounds down alike, so the threads still cover each row once
inline int64_t group_edge(const MatRef& mr, int64_t edge) { return mr.packed && edge < mr.n ? edge / 8 * 8 : edge; }

}  // namespace

void Act8::shape(int64_t rows, int64_t cols, bool want_blocks, bool want_supers) {
  TORCH_CHECK(cols % 32 == 0, "int8 activations need whole blocks of 32 values, got ", cols);
  TORCH_CHECK(!want_supers || cols % 256 == 0, "K-quant activations need whole super-blocks of 256, got ", cols);
  m = rows, k = cols, blocks = want_blocks, supers = want_supers;
  ldb = (cols / 32 + 7) / 8 * 8, nsb = cols / 256;
  if (blocks)  // s's padding stays zero
    qb.resize(rows * cols), d8.resize(rows * cols / 4), s.assign(rows * ldb, 0.f), c8.resize(rows * cols / 8);
  if (supers) qs.resize(rows * cols), dk.resize(rows * nsb), p.resize(rows * nsb * 8), pq.resize(rows * nsb * 8);
}

void Act8::quantize(int64_t r, const float* x) {
  if (blocks) quantize_blocks(r, x);
  if (supers) quantize_supers(r, x);
}

void Act8::quantize_blocks(int64_t r, const float* x) {
  const bool vec = path() >= PATH_AVX2;
  int8_t* q = qb.data() + r * k;
  float *d = d8.data() + r * k / 4, *sr = s.data() + r * ldb;
  int32_t* cr = c8.data() + r * k / 8;
  const int64_t done = vec ? blocks_row_avx2(x, k, q, d, sr, cr) : 0;
  blocks_row(x + done * 32, k - done * 32, q + done * 32, d + done * 8, sr + done, cr + done * 4,
             vec ? amax8_avx2 : amax8_scalar, vec ? round8_avx2 : round8_scalar);
}

void Act8::quantize_supers(int64_t r, const float* x) {
  const bool vec = path() >= PATH_AVX2;
  supers_row(x, k, qs.data() + r * k, dk.data() + r * nsb, p.data() + r * nsb * 8, pq.data() + r * nsb * 8,
             vec ? amax32_avx2 : amax32_scalar, vec ? round32_avx2 : round32_scalar);
}

// What the 8-bit form of a row leaves of it, r = x - x^ (x^ the value its q and scales stand for): the blocks' x^ =
// d q, the super-blocks' x^ = (dk p_j) q (dk p_j = A / 127 / 2^e_j exactly). One multiplication and one subtraction a
// value, compiled without FMA on every path (this file has no -march), so every path leaves the same residual.
static void blocks_residual(const float* x, int64_t k, const int8_t* q, const float* d8, float* r) {
  for (int64_t i = 0; i < k; ++i) r[i] = x[i] - d8[i / 4] * static_cast<float>(q[i]);  // d8: each group's d twice
}

static void supers_residual(const float* x, int64_t k, const int8_t* q, const float* dk, const int16_t* p, float* r) {
  for (int64_t s = 0; s < k / 256; ++s)
    for (int j = 0; j < 8; ++j) {
      const float step = dk[s] * static_cast<float>(p[8 * s + j]);
      for (int64_t i = 256 * s + 32 * j; i < 256 * s + 32 * j + 32; ++i) r[i] = x[i] - step * static_cast<float>(q[i]);
    }
}

void Act8::quantize_pair(int64_t r, const float* x) {
  thread_local std::vector<float> rest;
  rest.resize(k);
  if (blocks) {
    quantize_blocks(r, x);
    blocks_residual(x, k, qb.data() + r * k, d8.data() + r * k / 4, rest.data());
    quantize_blocks(r + 1, rest.data());
  }
  if (supers) {
    quantize_supers(r, x);
    supers_residual(x, k, qs.data() + r * k, dk.data() + r * nsb, p.data() + r * nsb * 8, rest.data());
    quantize_supers(r + 1, rest.data());
  }
}

void Act8::quantize_rows(const float* x, int64_t ldx) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1));  // a task of >= ~16K values
  if (m <= grain) {
    for (int64_t r = 0; r < m; ++r) quantize(r, x + r * ldx);
    return;
  }
  at::parallel_for(0, m, grain, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) quantize(r, x + r * ldx);
  });
}

void qmatmul8_multi(const Act8& a, int64_t row0, int64_t m, const float* x, const MatRef* mats, int count,
                    bool prompt) {
  int64_t total = 0, max_row_bytes = 0, total_bytes = 0;
  bool kquant = false;  // a K-quant matrix: a prompt's rows take a GEMM (packed8_gemm's tiles or gemm8_rows)
  for (int i = 0; i < count; ++i) {
    TORCH_CHECK(mats[i].qtype == F32 || (reads_blocks(mats[i].qtype) && a.blocks) ||
                    (reads_supers(mats[i].qtype) && a.supers),
                "int8 activations have no kernel for ggml type ", mats[i].qtype, " (or its form was not made)");
    total += mats[i].n;
    total_bytes += mats[i].n * mats[i].row_bytes;
    max_row_bytes = std::max(max_row_bytes, mats[i].row_bytes);
    kquant |= reads_supers(mats[i].qtype);
    TORCH_CHECK(!mats[i].packed || packs8(mats[i].qtype, mats[i].n), "matrix ", i, " is marked packed but ggml type ",
                mats[i].qtype, " with ", mats[i].n, " rows has no packed form");
  }
  TORCH_CHECK(row0 >= 0 && row0 + m <= a.m, "rows [", row0, ", ", row0 + m, ") are outside the ", a.m, " quantized");
  const int p = path();
  const int64_t k = a.k;
  const bool tiles = vnni();  // packed Q4_K takes packed8_gemm's tiles, which read no panel
  bool q8 = false;            // Q8_0 takes its GEMM on every path; packed Q8_0 its row kernels (the same order)
  for (int i = 0; i < count; ++i) q8 |= mats[i].qtype == Q8_0 && !mats[i].packed;
  // a short prompt's rows against packed Q5_K and Q6_K take their row kernels: the same bits (their order is the
  // unpacked GEMM's), where the GEMM gathers every weight row back first (a 5632 x 2048 Q6_K at 16 rows, 2 threads:
  // 1.01 ms so, 2.13 gathered; the row kernels 1.56x the unpacked GEMM at 32 rows, 1.03x at 48, Q5_K's 1.07x, 0.84x)
  const bool gemm = prompt && (kquant || q8), few = m <= 32;
  const auto rows_kernels = [few](const MatRef& mr) {
    return mr.packed && (mr.qtype == Q5_K || mr.qtype == Q6_K) && few;
  };
  thread_local std::vector<int32_t> q6t;  // packed Q6_K's group terms of the call's rows, made once for every chunk
  const int32_t* terms = nullptr;         // the calling thread's, as the workers read them
  bool six = false;
  for (int i = 0; i < count; ++i) six |= mats[i].packed && mats[i].qtype == Q6_K;
  if (six && p >= PATH_AVX2 && (!gemm || few)) {
    q6t.resize(static_cast<size_t>(m) * k / 16);
    q6k_group_terms(a, row0, m, vnni_kind() == 0, q6t.data());
    terms = q6t.data();
  }
  if (gemm) {  // the GEMM: every row of the call at once, weight rows over the threads
    thread_local Panel8 mine;  // the calling thread's; the workers read it through `panel`
    thread_local PanelB mine_b;
    const Panel8& panel = mine;
    const PanelB& panel_b = mine_b;
    bool panel_read = false;
    for (int i = 0; i < count; ++i)  // packed Q5_K's and Q6_K's longer prompts take the panel's GEMM
      panel_read |= reads_supers(mats[i].qtype) && !(mats[i].qtype == Q4_K && mats[i].packed && tiles) &&
                    !rows_kernels(mats[i]);
    if (p >= PATH_AVX2 && panel_read) mine.build(a, row0, m);
    if (p >= PATH_AVX2 && q8) mine_b.build(a, row0, m);
    at::parallel_for(0, (total + 15) / 16, 1, [&](int64_t b, int64_t e) {
      int64_t base = 0;
      for (int i = 0; i < count; ++i) {
        const MatRef& mr = mats[i];
        const int64_t lo = group_edge(mr, std::max(16 * b, base) - base) + base;
        const int64_t hi = group_edge(mr, std::min(16 * e, base + mr.n) - base) + base;
        if (lo < hi) {
          if (mr.qtype == Q8_0 && !mr.packed) {
            q8_gemm_rows(a, panel_b, row0, m, mr.w, mr.row_bytes, lo - base, hi - base, mr.y, mr.n, p);
          } else if (mr.packed && tiles && mr.qtype == Q4_K) {
            const Job8 j{&a, static_cast<int>(row0), static_cast<int>(m), mr.w, mr.row_bytes, a.k, mr.qtype, mr.y,
                         mr.n};
            packed8_gemm(j, lo - base, hi - base, p);
          } else if (rows_kernels(mr)) {
            rows_of(a, row0, static_cast<int>(m), x, mr, lo - base, hi - base, p, terms);
          } else if (reads_supers(mr.qtype)) {
            gemm8_rows(a, panel, row0, m, mr.w, mr.row_bytes, mr.qtype, lo - base, hi - base, mr.y, mr.n, p,
                       mr.packed);
          } else {
            rows_of(a, row0, static_cast<int>(m), x, mr, lo - base, hi - base, p);
          }
        }
        base += mr.n;
      }
    });
    return;
  }
  // A large call's rows in chunks: each thread owns a contiguous run of them (one stream through memory, as a static
  // split) and takes them by a cursor; a thread done with its own run takes chunks from the others' cursors, so a
  // thread slowed by its memory or by another process does not hold the rest at the region's end (ggml's chunks, with
  // the static split's streams kept). Each row's numbers are the same whichever thread computes it.
  const int threads = at::get_num_threads();
  for (int64_t m0 = 0; m0 < m; m0 += 64) {  // 64 activation rows at a time stay in L2 while w streams
    const int mm = static_cast<int>(std::min<int64_t>(64, m - m0));
    const auto rows = [&](int64_t b, int64_t e) {
      int64_t base = 0;
      for (int i = 0; i < count; ++i) {
        const MatRef& mr = mats[i];
        const int64_t lo = group_edge(mr, std::max(b, base) - base) + base;
        const int64_t hi = group_edge(mr, std::min(e, base + mr.n) - base) + base;
        if (lo < hi) {
          const MatRef part{mr.w, mr.n, mr.row_bytes, mr.qtype, mr.y + m0 * mr.n, mr.packed};
          rows_of(a, row0 + m0, mm, x + m0 * k, part, lo - base, hi - base, p,
                  terms != nullptr ? terms + m0 * k / 16 : nullptr);
        }
        base += mr.n;
      }
    };
    const int64_t chunks = std::min<int64_t>(int64_t(threads) * CHUNKS_A_THREAD, total_bytes / CHUNK_BYTES);
    if (threads < 2 || chunks <= threads) {  // a small call: an even split (each run's stream too short to break up)
      const int64_t grain = std::max<int64_t>(8, 16384 / (max_row_bytes * std::min(mm, 4)));
      at::parallel_for(0, total, grain, rows);
      continue;
    }
    const int64_t step = (total + chunks - 1) / chunks;
    std::vector<std::atomic<int64_t>> cursor(threads);
    for (int t = 0; t < threads; ++t) cursor[t] = chunks * t / threads;
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t) {  // one index a thread (inline: all of them in turn)
      for (int i = 0; i < threads; ++i) {
        const int t = static_cast<int>((t0 + i) % threads);
        const int64_t end = chunks * (t + 1) / threads;
        for (int64_t c = cursor[t]++; c < end; c = cursor[t]++) rows(c * step, std::min(total, (c + 1) * step));
      }
    });
  }
}

}  // namespace wq
