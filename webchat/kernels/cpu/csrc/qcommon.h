// Shared by the quantized-matmul sources: block formats, the job a thread works on, float16 decoding.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace wq {

enum QType { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // ggml's numbers
enum Path { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_AVX512 = 2 };

template <int QT> struct BlockOf;
template <> struct BlockOf<Q4_0> { static constexpr int bytes = 18; };
template <> struct BlockOf<Q4_1> { static constexpr int bytes = 20; };
template <> struct BlockOf<Q5_0> { static constexpr int bytes = 22; };
template <> struct BlockOf<Q5_1> { static constexpr int bytes = 24; };
template <> struct BlockOf<Q8_0> { static constexpr int bytes = 34; };

// Weight rows stream from memory once a token, a few hundred bytes to a few KB each, and the hardware prefetcher
// alone leaves the kernels waiting on memory: every vector kernel asks for the row PREFETCH_AHEAD bytes past the one it
// starts. Measured on the AVX-512 Xeon (bench/bench_step.py, one-row forward): SmolLM2-135M 10.1 -> 5.5-6.5 ms, the
// 1.1B-shaped file 75-84 -> 50 ms; 4 KB ahead gave 55 ms on the 1.1B (its rows are 1.3-3.5 KB), 16-64 KB all ~50;
// _MM_HINT_T1 was no better than T0. Prefetches never fault, so the rows past a matrix's end are safe to ask for (as
// an address: the pointer itself never goes past its object).
constexpr int64_t PREFETCH_AHEAD = 16384;
inline void prefetch_ahead(const uint8_t* row, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row) + PREFETCH_AHEAD + o), _MM_HINT_T0);
}

// The same distance ahead, asked for a unit (a block, a super-block) at a time as the kernel reads it: a row's or a
// packed group's whole span at once queues more misses than a core keeps in flight, and the int8 kernels (fast enough
// to wait on memory) streamed at half the rate (docs/perf-history.md, issue 38's second try)
inline void prefetch_span(const uint8_t* unit, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(unit) + PREFETCH_AHEAD + o), _MM_HINT_T0);
}

inline int64_t block_bytes(int64_t qtype) {  // the 32-value blocks; 0 for any other type
  return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q5_0 ? 22 : qtype == Q5_1 ? 24 : qtype == Q8_0 ? 34 : 0;
}

// one call: y rows [0, m) of width ldy, x rows of stride ldx, xsum (m, k/32), w rows of row_bytes
struct Job {
  const float* x;
  int64_t ldx;
  const float* xsum;
  const uint8_t* w;
  int64_t row_bytes;
  int m;
  int64_t k;
  int qtype;
  float* y;
  int64_t ldy;
  const float* xp = nullptr;  // the vector paths' Q4_0/Q4_1 x, rows of ldxp laid out as the nibbles fall (permute_x)
  int64_t ldxp = 0;
  const float* xk = nullptr;  // their Q4_K x, rows of k laid out likewise (qkquant.cpp)
};

// IEEE half -> float without F16C (the scalar path must run on any x86-64)
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) man <<= 1, --exp;
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The 8 six-bit scales and the 8 mins of a Q4_K/Q5_K super-block's 12 bytes, as bytes (ggml's kmask unpacking:
// get_scale_min_k4's values, four at a time)
inline void scales_mins_k4(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  uint32_t u[3], out[4];
  std::memcpy(u, s, 12);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  out[0] = u[0] & k1;
  out[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  out[2] = u[1] & k1;
  out[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  std::memcpy(sc, out, 8), std::memcpy(mn, out + 2, 8);
}

// the sum of a vector's 8 lanes, ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)): every AVX2 kernel's one
// horizontal sum (target avx2 only, so it inlines into callers built for avx2+fma(+f16c))
__attribute__((target("avx2"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// the largest of x[0, n) (-inf for n = 0): four chains of vector maxes, so the loop does not wait on one max's latency
// a vector (a scalar maxss chain does at every value); the same value as any order's (no NaN). The sampler's scans
// (qsample.cpp) and the attention's softmax (qstep.cpp) take it.
__attribute__((target("avx2"))) inline float max_avx2(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m, m2 = m, m3 = m;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m = _mm256_max_ps(m, _mm256_loadu_ps(x + i)), m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
    m2 = _mm256_max_ps(m2, _mm256_loadu_ps(x + i + 16)), m3 = _mm256_max_ps(m3, _mm256_loadu_ps(x + i + 24));
  }
  m = _mm256_max_ps(_mm256_max_ps(m, m1), _mm256_max_ps(m2, m3));
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float r = lanes[0];
  for (int l = 1; l < 8; ++l) r = lanes[l] > r ? lanes[l] : r;
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

// e^x for 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial), within ~2 ulp of
// std::exp for x in [-87.3, 88.7]; outside it the result saturates (to ~1e-38 and ~1.6e38), never NaN or inf
__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365447504f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// e^x for 16 lanes: exp256's Cephes expf on AVX-512 (a lane's bits are exp256's), within ~2 ulp for x in [-87.3, 88.7], saturating
// outside it
__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3365447504f)), _mm512_set1_ps(88.3762626647949f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}

// Nibbles masked where they lie (the vector paths' Q4_0/Q4_1 and Q4_K kernels): of each 32-bit word of w, the nibble
// at bits 4V as q * 2^4V, exactly, in float (V = 7 by a shift: its bit 31 would read as a sign). x is laid out to
// match, times 2^-4V (permute_x in qmatmul.cpp), so each product is q * x.
template <int V>
__attribute__((target("avx2"))) inline __m256 nibble_at(__m256i w) {
  return _mm256_cvtepi32_ps(V == 7 ? _mm256_srli_epi32(w, 28) : _mm256_and_si256(w, _mm256_set1_epi32(15 << 4 * V)));
}
template <int V>
__attribute__((target("avx512f"))) inline __m512 nibble_at(__m512i w) {
  return _mm512_cvtepi32_ps(V == 7 ? _mm512_srli_epi32(w, 28) : _mm512_and_si512(w, _mm512_set1_epi32(15 << 4 * V)));
}

extern int g_path;
int best_path();
int path();
struct MatRef {  // one matrix of a qmatmul_multi call and where its output goes (rows of n floats)
  const uint8_t* w;  // F32: float rows of k (row_bytes = 4k)
  int64_t n, row_bytes;
  int qtype;
  float* y;
  bool packed = false;  // rows packed 8 to a group for the int8 kernels (qpack8.cpp)
};
// y_i (m, n_i) = x (m, k) @ W_i^T for matrices sharing x and k (q/k/v, gate/up): one parallel region over all
// their output rows; xsum2 scratch (m, k/32, 2)
void qmatmul_multi(const float* x, int64_t m, int64_t k, const MatRef* mats, int count, float* xsum2);
// the same products for rows of a prompt, as a GEMM over dequantized tiles of W (qgemm.cpp): each output the same
// whatever else is in x; amx_ok: on AMX tiles where amx_covers the call (qgemm_amx.cpp), FMA tiles otherwise
void qgemm_multi(const float* x, int64_t m, int64_t k, const MatRef* mats, int count, bool amx_ok = false);
// the same on AMX tiles (qgemm_amx.cpp): where amx_covers the call (AMX-BF16 granted, the AVX-512 path, quantized
// matrices of whole blocks), float32-accurate products summed in another order
bool amx();            // the exact GEMM takes AMX tiles where it covers a call
int set_amx(int on);   // -1: where the CPU and the OS allow it, 0: off, 1: on; returns whether on
bool amx_covers(const MatRef* mats, int count, int64_t k);
void qgemm_amx_multi(const float* x, int64_t m, int64_t k, const MatRef* mats, int count);
// one row of a matrix of any type as float32 (k values): the embedding lookup, the PyTorch path's dequantized matrices
void dequant_row(int qtype, const uint8_t* row, int64_t k, float* out);
// the float32 row kernels on a Job of F32 rows (qmatmul.cpp): the int8 matmul's float matrices
void float_rows(const Job& j, int64_t n0, int64_t n1, int p);
void qmatmul_raw(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes, int qtype,
                 float* xsum2, float* y);

// Q4_K / Q5_K / Q6_K (qkquant.cpp): 256-value super-blocks of kq_block_bytes; rows [n0, n1) of a Job (its xsum the
// (m, k / 32, 2) block sums) and one dequantized row (the embedding)
inline bool is_kquant(int64_t qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K; }
int64_t kq_block_bytes(int qtype);
void kq_rows(const Job& j, int64_t n0, int64_t n1, int p);
void kq_dequant_row(int qtype, const uint8_t* row, int64_t k, float* out);

// The sampler's scans of one logits row of n floats (qsample.cpp), on the calling thread:
// the index of its first largest value (torch.argmax's rule) ...
int64_t argmax_row(const float* x, int64_t n);
// ... and what softmax makes of token t: its probability, its 1-based rank (1 + how many logits exceed its own), and
// the k most likely tokens by logit (ties: the lower id first) with their probabilities, k <= n
void describe_row(const float* x, int64_t n, int64_t t, int k, float* prob, int64_t* rank, int64_t* top_ids,
                  float* top_probs);

}  // namespace wq
