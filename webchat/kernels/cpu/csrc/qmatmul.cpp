// Quantized matmul for ggml's block formats with float32 activations and float32 accumulation (docs/quant.md).
//
//   y[m, n] = sum_k x[m, k] * w[n, k],   w[n, k] = dequant(block k/32 of row n)[k % 32]
//   Q4_0 (18 B): f16 d, 16 B nibbles;          w = d * (q - 8)
//   Q4_1 (20 B): f16 d, f16 m, 16 B nibbles;   w = d * q + m
//   Q8_0 (34 B): f16 d, 32 x int8;             w = d * q
// Nibble j of a block (j < 16) is byte j & 0xF; element j + 16 is byte j >> 4 (ggml's order).
// The integer q is widened to float, never the activations narrowed, so the result is the float32 product with the
// dequantized weights up to the order of the float additions: every path computes y += d * sum(q * x) + m * sum(x)
// per block, the zero-point sums of x taken once per call.
//
// Three code paths, chosen at run time (__builtin_cpu_supports) or forced by set_path(): scalar (any x86-64),
// AVX2+FMA+F16C, AVX-512F+BW. Threads: at::parallel_for, so the work runs on torch's own OpenMP pool (one runtime,
// no oversubscription). Rows of x go through a 16-row tile of w in groups (8 on AVX2, 4 on AVX-512), so each
// decoded weight block feeds a group's rows; each row's sums run in the same order whatever the group. Both vector
// paths' Q4 kernels mask the nibbles in place against a copy of x laid out to match (permute_x): rows_avx2_q4 two
// blocks a pass, rows_avx512_q4 four.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

#include "qcommon.h"

namespace wq {

int g_path = -1;  // -1: not chosen yet; PATH_SCALAR, PATH_AVX2, PATH_AVX512

int best_path() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return PATH_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return PATH_AVX2;
  return PATH_SCALAR;
}

int path() {
  if (g_path < 0) g_path = best_path();
  return g_path;
}

// ---------------------------------------------------------------- scalar (reference order: one block at a time)
template <int QT>
static void rows_scalar(const Job& j, int64_t n0, int64_t n1) {
  const int64_t nb = j.k / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    for (int r = 0; r < j.m; ++r) {
      const float* x = j.x + r * j.ldx;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * BlockOf<QT>::bytes;
        const float* xb = x + b * 32;
        float dot = 0.f;
        if (QT == Q8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
          for (int i = 0; i < 32; ++i) dot += float(q[i]) * xb[i];
          acc += half_to_float(blk) * dot;
        } else {
          const uint8_t* q = blk + (QT == Q4_1 ? 4 : 2);
          for (int i = 0; i < 16; ++i) dot += float(q[i] & 15) * xb[i] + float(q[i] >> 4) * xb[i + 16];
          const float d = half_to_float(blk);
          const float mn = QT == Q4_1 ? half_to_float(blk + 2) : -8.f * d;
          acc += d * dot + mn * j.xsum[(r * nb + b) * 2 + 1];
        }
      }
      j.y[r * j.ldy + n] = acc;
    }
  }
}

// ---------------------------------------------------------------- AVX2: 8 lanes, 4 vectors per block
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET static inline float f16_avx2(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q8_0 on AVX2: y[r, n] for R rows of x against weight rows [n0, n1). Each block's 32 int8 weights are widened to
// 4 x 8 floats once (sign-extending loads) and feed R rows: per row and block, y += d * (q . x), 4 multiply-adds.
// The order of a row's sums does not depend on R, so a row's result does not depend on how many rows share the
// call. (Q4_0 and Q4_1 take rows_avx2_q4 below.)
template <int R>
AVX2_TARGET static void rows_avx2_q8(const Job& j, int r0, int64_t n0, int64_t n1) {
  const int64_t nb = j.k / 32;
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = j.x + (r0 + r) * j.ldx;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    prefetch_ahead(row, j.row_bytes);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * BlockOf<Q8_0>::bytes;
      __m256 w[4];
      for (int i = 0; i < 4; ++i)
        w[i] = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i))));
      const __m256 vd = _mm256_set1_ps(f16_avx2(blk));
      for (int r = 0; r < R; ++r) {
        const float* xb = x[r] + b * 32;
        __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
        p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), p);
        p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), p);
        p = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), p);
        acc[r] = _mm256_fmadd_ps(vd, p, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) j.y[(r0 + r) * j.ldy + n] = hsum256(acc[r]);
  }
}

// Q4_0 / Q4_1 on AVX2, two blocks a pass, the nibbles never moved. The 16 nibble bytes of block A and of block B fill
// the two halves of one vector: 8 words of 8 nibbles. `word & (15 << 4v)` is q * 2^4v exactly, so the 8 nibble
// positions v give 8 vectors of 8 weights with one AND and one conversion each (no widening shuffles, no shifts;
// v = 7 is a shift, its bit 31 would read as a sign). Row r of x comes in j.xp laid out to match (permute_x):
// vector v, lane l holds x at that nibble's element, times 2^-4v, so each product is exactly q * x, as on the other
// paths. Per lane, the 8 products sum in a fixed order, then acc += (dA x4, dB x4) * that; m * sum(x) goes in a
// 4-lane accumulator (lanes 1, 3). A row's order does not depend on R, nor on the other rows. (The same trick for
// Q8_0, bytes shifted to the top of their words, was 18% faster alone but not in the forward, where the 34-byte
// blocks of the 49152-row head stream at ~11 GB/s: kept as the sign-extending loads.)
template <int QT>
AVX2_TARGET static inline __m128 dm_pair(const uint8_t* a, const uint8_t* b) {  // (dA, mA, dB, mB); Q4_0: m = 0
  int32_t ra, rb = 0;
  std::memcpy(&ra, a, 4);
  if (b) std::memcpy(&rb, b, 4);
  if (QT == Q4_0) ra &= 0xffff, rb &= 0xffff;
  return _mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128(ra), _mm_cvtsi32_si128(rb)));
}

template <int QT, int R>
AVX2_TARGET static void rows_avx2_q4(const Job& j, int r0, int64_t n0, int64_t n1) {
  constexpr int64_t BB = BlockOf<QT>::bytes, Q = QT == Q4_1 ? 4 : 2;
  const int64_t nb = j.k / 32, np = (nb + 1) / 2;
  const float* x[R];
  const float* xs[R];
  for (int r = 0; r < R; ++r) x[r] = j.xp + (r0 + r) * j.ldxp, xs[r] = j.xsum + (r0 + r) * nb * 2;
  const __m256i sel = _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    prefetch_ahead(row, j.row_bytes);
    __m256 acc[R];
    __m128 macc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), macc[r] = _mm_setzero_ps();
    for (int64_t b = 0; b < np; ++b) {
      const uint8_t* a = row + 2 * b * BB;
      const bool pair = 2 * b + 1 < nb;  // the last pass of an odd count has block A only: B's half is zeros
      const __m128i qa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + Q));
      const __m256i wd = pair ? _mm256_inserti128_si256(_mm256_castsi128_si256(qa),
                                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + BB + Q)), 1)
                              : _mm256_zextsi128_si256(qa);
      const __m128 dm = dm_pair<QT>(a, pair ? a + BB : nullptr);
      const __m256 vd = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dm), sel);
      // the zero points in lanes 1, 3 (lanes 0, 2 meet xsum's zeros); Q4_0's is -8d
      const __m128 mn = QT == Q4_0 ? _mm_mul_ps(_mm_moveldup_ps(dm), _mm_set1_ps(-8.f)) : dm;
      __m256 p[R], p2[R];
      {
        const __m256 w0 = nibble_at<0>(wd);
        const __m256 w1 = nibble_at<1>(wd);
        const __m256 w2 = nibble_at<2>(wd);
        const __m256 w3 = nibble_at<3>(wd);
        for (int r = 0; r < R; ++r) {
          const float* xb = x[r] + b * 64;
          p[r] = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
          p2[r] = _mm256_mul_ps(w1, _mm256_loadu_ps(xb + 8));
          p[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), p[r]);
          p2[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), p2[r]);
        }
      }
      const __m256 w4 = nibble_at<4>(wd);
      const __m256 w5 = nibble_at<5>(wd);
      const __m256 w6 = nibble_at<6>(wd);
      const __m256 w7 = nibble_at<7>(wd);
      for (int r = 0; r < R; ++r) {
        const float* xb = x[r] + b * 64;
        p[r] = _mm256_fmadd_ps(w4, _mm256_loadu_ps(xb + 32), p[r]);
        p2[r] = _mm256_fmadd_ps(w5, _mm256_loadu_ps(xb + 40), p2[r]);
        p[r] = _mm256_fmadd_ps(w6, _mm256_loadu_ps(xb + 48), p[r]);
        p2[r] = _mm256_fmadd_ps(w7, _mm256_loadu_ps(xb + 56), p2[r]);
        acc[r] = _mm256_fmadd_ps(vd, _mm256_add_ps(p[r], p2[r]), acc[r]);
        const __m128 s = pair ? _mm_loadu_ps(xs[r] + 4 * b)  // (0, sum A, 0, sum B)
                              : _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(xs[r] + 4 * b)));
        macc[r] = _mm_fmadd_ps(mn, s, macc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m128 m = _mm_add_ss(_mm_movehdup_ps(macc[r]), _mm_shuffle_ps(macc[r], macc[r], 3));
      j.y[(r0 + r) * j.ldy + n] = hsum256(acc[r]) + _mm_cvtss_f32(m);
    }
  }
}

// x rows (m, k) -> rows of ldxp for the kernels that mask nibbles in place. The weights come in chunks of W words
// (W = 4: a Q4_0/Q4_1 block's 16 bytes, 32 values; W = 8: a Q4_K chunk's 32 bytes, 64 values), byte i of a chunk
// holding values i (low nibble) and i + 4W (high); a vector of L lanes (8 on AVX2, 16 on AVX-512) holds L / W chunks.
// Pass b, vector v, lane l holds value 4W (v % 2) + 4 (l % W) + v / 2 of chunk (L / W) b + l / W, times 2^-4v
// (v < 7; v = 7 unscaled): the value whose nibble sits at bits 4v of that lane's word. A last pass short of chunks is
// padded with zeros. Scaling by a power of two is exact.
static int64_t xp_stride(int64_t nb, int lanes) { return (nb + lanes / 4 - 1) / (lanes / 4) * 8 * lanes; }

template <int LANES, int WORDS>  // known at compile time, so the divisions below are shifts and masks
static void permute_x_as(const float* x, int64_t m, int64_t k, int64_t ldx, float* xp, int64_t ldxp) {
  constexpr int per = LANES / WORDS, width = 8 * LANES;
  const int64_t chunks = k / (8 * WORDS);
  for (int64_t r = 0; r < m; ++r) {
    float* out = xp + r * ldxp;
    for (int64_t b = 0; b < ldxp / width; ++b)
      for (int v = 0; v < 8; ++v) {
        const float scale = v < 7 ? 1.f / float(1 << 4 * v) : 1.f;
        for (int l = 0; l < LANES; ++l) {
          const int64_t chunk = per * b + l / WORDS;
          const int e = 4 * WORDS * (v % 2) + 4 * (l % WORDS) + v / 2;
          out[b * width + v * LANES + l] = chunk < chunks ? x[r * ldx + 8 * WORDS * chunk + e] * scale : 0.f;
        }
      }
  }
}

// (runtime lanes and words divided in the innermost loop were ~2% of a decode step's samples, on one thread)
static void permute_x(const float* x, int64_t m, int64_t k, int64_t ldx, float* xp, int64_t ldxp, int lanes,
                      int words) {
  if (lanes == 16 && words == 4) return permute_x_as<16, 4>(x, m, k, ldx, xp, ldxp);
  if (lanes == 8 && words == 4) return permute_x_as<8, 4>(x, m, k, ldx, xp, ldxp);
  if (lanes == 16 && words == 8) return permute_x_as<16, 8>(x, m, k, ldx, xp, ldxp);
  if (lanes == 8 && words == 8) return permute_x_as<8, 8>(x, m, k, ldx, xp, ldxp);
  TORCH_CHECK(false, "permute_x: no layout for ", lanes, " lanes of ", words, " words");
}

// ---------------------------------------------------------------- AVX-512: 16 lanes
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))

// Q8_0 on AVX-512: a block's 32 int8 sign-extended into two vectors of 16, acc += d * (q . x)
template <int R>
AVX512_TARGET static void rows_avx512_q8(const Job& j, int r0, int64_t n0, int64_t n1) {
  const int64_t nb = j.k / 32;
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = j.x + (r0 + r) * j.ldx;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    prefetch_ahead(row, j.row_bytes);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * BlockOf<Q8_0>::bytes;
      __m512 w[2];
      for (int i = 0; i < 2; ++i)
        w[i] = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * i))));
      const __m512 vd = _mm512_set1_ps(f16_avx2(blk));
      for (int r = 0; r < R; ++r) {
        const float* xb = x[r] + b * 32;
        __m512 p = _mm512_mul_ps(w[0], _mm512_loadu_ps(xb));
        p = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 16), p);
        acc[r] = _mm512_fmadd_ps(vd, p, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) j.y[(r0 + r) * j.ldy + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

// Q4_0 / Q4_1 on AVX-512: rows_avx2_q4's masking at 16 lanes, four blocks a pass (their 16 nibble bytes in the four
// 128-bit quarters of one vector), x from j.xp laid out by permute_x with 16 lanes. (dA, mA, .., dD, mD) come from
// one conversion of the four blocks' headers; the zero points go in an 8-lane accumulator against xsum's
// (0, sum) pairs of the same four blocks. A missing block of the last pass reads as zeros.
template <int QT, int R>
AVX512_TARGET static void rows_avx512_q4(const Job& j, int r0, int64_t n0, int64_t n1) {
  constexpr int64_t BB = BlockOf<QT>::bytes, Q = QT == Q4_1 ? 4 : 2;
  const int64_t nb = j.k / 32, np = (nb + 3) / 4;
  const float* x[R];
  const float* xs[R];
  for (int r = 0; r < R; ++r) x[r] = j.xp + (r0 + r) * j.ldxp, xs[r] = j.xsum + (r0 + r) * nb * 2;
  const __m512i sel = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    prefetch_ahead(row, j.row_bytes);
    __m512 acc[R];
    __m256 macc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < np; ++b) {
      const uint8_t* a = row + 4 * b * BB;
      const int have = nb - 4 * b < 4 ? static_cast<int>(nb - 4 * b) : 4;
      __m512i wd;
      __m128i hdr;
      if (have == 4) {
        // (one 64-byte load and a vpermt2w or vpermt2b to gather the four blocks measured slower than these inserts)
        wd = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + Q)));
        wd = _mm512_inserti32x4(wd, _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + BB + Q)), 1);
        wd = _mm512_inserti32x4(wd, _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 2 * BB + Q)), 2);
        wd = _mm512_inserti32x4(wd, _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 3 * BB + Q)), 3);
        int32_t h0, h1, h2, h3;
        std::memcpy(&h0, a, 4), std::memcpy(&h1, a + BB, 4), std::memcpy(&h2, a + 2 * BB, 4);
        std::memcpy(&h3, a + 3 * BB, 4);
        hdr = _mm_insert_epi32(_mm_insert_epi32(_mm_insert_epi32(_mm_cvtsi32_si128(h0), h1, 1), h2, 2), h3, 3);
      } else {
        alignas(64) uint8_t q[64] = {};
        int32_t h[4] = {0, 0, 0, 0};
        for (int i = 0; i < have; ++i) std::memcpy(q + 16 * i, a + i * BB + Q, 16), std::memcpy(&h[i], a + i * BB, 4);
        wd = _mm512_load_si512(q);
        hdr = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
      }
      if (QT == Q4_0) hdr = _mm_and_si128(hdr, _mm_set1_epi32(0xffff));  // Q4_0's header is d alone
      const __m256 dm = _mm256_cvtph_ps(hdr);                             // (dA, mA, dB, mB, dC, mC, dD, mD)
      const __m512 vd = _mm512_permutexvar_ps(sel, _mm512_castps256_ps512(dm));
      // the zero points in the odd lanes (the even ones meet xsum's zeros); Q4_0's is -8d
      const __m256 mn = QT == Q4_0 ? _mm256_mul_ps(_mm256_moveldup_ps(dm), _mm256_set1_ps(-8.f)) : dm;
      const __mmask16 smask = static_cast<__mmask16>((1u << (2 * have)) - 1);
      __m512 p[R], p2[R];
      {
        const __m512 w0 = nibble_at<0>(wd);
        const __m512 w1 = nibble_at<1>(wd);
        const __m512 w2 = nibble_at<2>(wd);
        const __m512 w3 = nibble_at<3>(wd);
        for (int r = 0; r < R; ++r) {
          const float* xb = x[r] + b * 128;
          p[r] = _mm512_mul_ps(w0, _mm512_loadu_ps(xb));
          p2[r] = _mm512_mul_ps(w1, _mm512_loadu_ps(xb + 16));
          p[r] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xb + 32), p[r]);
          p2[r] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xb + 48), p2[r]);
        }
      }
      const __m512 w4 = nibble_at<4>(wd);
      const __m512 w5 = nibble_at<5>(wd);
      const __m512 w6 = nibble_at<6>(wd);
      const __m512 w7 = nibble_at<7>(wd);
      for (int r = 0; r < R; ++r) {
        const float* xb = x[r] + b * 128;
        p[r] = _mm512_fmadd_ps(w4, _mm512_loadu_ps(xb + 64), p[r]);
        p2[r] = _mm512_fmadd_ps(w5, _mm512_loadu_ps(xb + 80), p2[r]);
        p[r] = _mm512_fmadd_ps(w6, _mm512_loadu_ps(xb + 96), p[r]);
        p2[r] = _mm512_fmadd_ps(w7, _mm512_loadu_ps(xb + 112), p2[r]);
        acc[r] = _mm512_fmadd_ps(vd, _mm512_add_ps(p[r], p2[r]), acc[r]);
        const __m256 s = _mm512_castps512_ps256(_mm512_maskz_loadu_ps(smask, xs[r] + 8 * b));  // (0, sum A, .., 0, sum D)
        macc[r] = _mm256_fmadd_ps(mn, s, macc[r]);
      }
    }
    for (int r = 0; r < R; ++r) j.y[(r0 + r) * j.ldy + n] = _mm512_reduce_add_ps(acc[r]) + hsum256(macc[r]);
  }
}

// ---------------------------------------------------------------- float32 rows (the float path's matrices)
template <int R>
AVX2_TARGET static void rows_f32_avx2_r(const Job& j, int r0, int64_t n0, int64_t n1) {
  const int64_t k = j.k, k8 = k / 8 * 8;
  for (int64_t n = n0; n < n1; ++n) {
    const float* w = reinterpret_cast<const float*>(j.w + n * j.row_bytes);
    prefetch_ahead(j.w + n * j.row_bytes, j.row_bytes);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k8; c += 8) {
      const __m256 wv = _mm256_loadu_ps(w + c);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(j.x + (r0 + r) * j.ldx + c), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float s = hsum256(acc[r]);
      for (int64_t c = k8; c < k; ++c) s += w[c] * j.x[(r0 + r) * j.ldx + c];
      j.y[(r0 + r) * j.ldy + n] = s;
    }
  }
}

static void rows_f32_scalar(const Job& j, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* w = reinterpret_cast<const float*>(j.w + n * j.row_bytes);
    for (int r = 0; r < j.m; ++r) {
      const float* x = j.x + r * j.ldx;
      float s = 0.f;
      for (int64_t c = 0; c < j.k; ++c) s += w[c] * x[c];
      j.y[r * j.ldy + n] = s;
    }
  }
}

// ---------------------------------------------------------------- dispatch over row groups of 4
template <int QT>
static void rows(const Job& j, int64_t n0, int64_t n1, int p) {
  if (p == PATH_SCALAR) {
    if constexpr (QT == F32) return rows_f32_scalar(j, n0, n1);
    else return rows_scalar<QT>(j, n0, n1);
  }
  for (int64_t t0 = n0; t0 < n1; t0 += 16) {  // 16 weight rows stay in L1 while every group of 4 x rows passes
    const int64_t t1 = t0 + 16 < n1 ? t0 + 16 : n1;
    const int group = p == PATH_AVX2 && QT != F32 ? 8 : 4;  // x rows per pass over the tile
    for (int r0 = 0; r0 < j.m; r0 += group) {
      const int rr = j.m - r0 < group ? j.m - r0 : group;
      if constexpr (QT == F32) {  // AVX2 serves both vector paths: a float row is bandwidth-bound either way
        switch (rr) {
          case 1: rows_f32_avx2_r<1>(j, r0, t0, t1); break;
          case 2: rows_f32_avx2_r<2>(j, r0, t0, t1); break;
          case 3: rows_f32_avx2_r<3>(j, r0, t0, t1); break;
          default: rows_f32_avx2_r<4>(j, r0, t0, t1); break;
        }
      } else if (p == PATH_AVX512) {
        if constexpr (QT == Q4_0 || QT == Q4_1) {
          switch (rr) {
            case 1: rows_avx512_q4<QT, 1>(j, r0, t0, t1); break;
            case 2: rows_avx512_q4<QT, 2>(j, r0, t0, t1); break;
            case 3: rows_avx512_q4<QT, 3>(j, r0, t0, t1); break;
            default: rows_avx512_q4<QT, 4>(j, r0, t0, t1); break;
          }
        } else {  // Q8_0
          switch (rr) {
            case 1: rows_avx512_q8<1>(j, r0, t0, t1); break;
            case 2: rows_avx512_q8<2>(j, r0, t0, t1); break;
            case 3: rows_avx512_q8<3>(j, r0, t0, t1); break;
            default: rows_avx512_q8<4>(j, r0, t0, t1); break;
          }
        }
      } else if constexpr (QT == Q4_0 || QT == Q4_1) {
        switch (rr) {
          case 1: rows_avx2_q4<QT, 1>(j, r0, t0, t1); break;
          case 2: rows_avx2_q4<QT, 2>(j, r0, t0, t1); break;
          case 3: rows_avx2_q4<QT, 3>(j, r0, t0, t1); break;
          case 4: rows_avx2_q4<QT, 4>(j, r0, t0, t1); break;
          case 5: rows_avx2_q4<QT, 5>(j, r0, t0, t1); break;
          case 6: rows_avx2_q4<QT, 6>(j, r0, t0, t1); break;
          case 7: rows_avx2_q4<QT, 7>(j, r0, t0, t1); break;
          default: rows_avx2_q4<QT, 8>(j, r0, t0, t1); break;
        }
      } else {  // Q8_0
        switch (rr) {
          case 1: rows_avx2_q8<1>(j, r0, t0, t1); break;
          case 2: rows_avx2_q8<2>(j, r0, t0, t1); break;
          case 3: rows_avx2_q8<3>(j, r0, t0, t1); break;
          case 4: rows_avx2_q8<4>(j, r0, t0, t1); break;
          case 5: rows_avx2_q8<5>(j, r0, t0, t1); break;
          case 6: rows_avx2_q8<6>(j, r0, t0, t1); break;
          case 7: rows_avx2_q8<7>(j, r0, t0, t1); break;
          default: rows_avx2_q8<8>(j, r0, t0, t1); break;
        }
      }
    }
  }
}

// Q5_0 / Q5_1 with float32 activations: each weight row dequantized (dequant_row, the values the PyTorch path's
// matrices hold) and dotted with every x row, 8 lanes and one hsum on the vector paths, in order on the scalar one
static void rows_via_dequant(const Job& j, int64_t n0, int64_t n1, int p) {
  thread_local std::vector<float> buf;
  buf.resize(j.k);
  for (int64_t n = n0; n < n1; ++n) {
    dequant_row(j.qtype, j.w + n * j.row_bytes, j.k, buf.data());
    const Job f{j.x, j.ldx, nullptr, reinterpret_cast<const uint8_t*>(buf.data()), 4 * j.k, j.m, j.k, F32,
                j.y + n, j.ldy};
    rows<F32>(f, 0, 1, p);
  }
}

static void run_rows(const Job& j, int64_t n0, int64_t n1, int p) {
  switch (j.qtype) {
    case F32: return rows<F32>(j, n0, n1, p);
    case Q4_0: return rows<Q4_0>(j, n0, n1, p);
    case Q4_1: return rows<Q4_1>(j, n0, n1, p);
    case Q5_0:
    case Q5_1: return rows_via_dequant(j, n0, n1, p);
    case Q4_K:
    case Q5_K:
    case Q6_K: return kq_rows(j, n0, n1, p);
    default: return rows<Q8_0>(j, n0, n1, p);
  }
}

void float_rows(const Job& j, int64_t n0, int64_t n1, int p) { rows<F32>(j, n0, n1, p); }

// xsum2[r, b] = (0, sum of x[r, 32b .. 32b+31]): the zero-point term of Q4_0/Q4_1, shared by every output row
static void block_sums(const float* x, int64_t m, int64_t k, float* xsum2) {
  constexpr int64_t G = 8;  // blocks summed side by side: each its own chain of 32 additions, in order, as alone
  const int64_t nb = k / 32;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b0 = 0; b0 < nb; b0 += G) {
      const int64_t g = std::min(G, nb - b0);
      float s[G] = {};
      for (int t = 0; t < 32; ++t)
        for (int64_t i = 0; i < g; ++i) s[i] += x[r * k + (b0 + i) * 32 + t];
      for (int64_t i = 0; i < g; ++i) {
        xsum2[(r * nb + b0 + i) * 2] = 0.f;
        xsum2[(r * nb + b0 + i) * 2 + 1] = s[i];
      }
    }
}

void qmatmul_multi(const float* x, int64_t m, int64_t k, const MatRef* mats, int count, float* xsum2) {
  const int64_t nb = k / 32;
  bool zero_points = false, q4 = false, q4k = false;
  int64_t total = 0, max_row_bytes = 0;
  for (int i = 0; i < count; ++i) {
    zero_points |= mats[i].qtype == Q4_0 || mats[i].qtype == Q4_1 || mats[i].qtype == Q4_K || mats[i].qtype == Q5_K;
    q4 |= mats[i].qtype == Q4_0 || mats[i].qtype == Q4_1;
    q4k |= mats[i].qtype == Q4_K;
    total += mats[i].n;
    max_row_bytes = std::max(max_row_bytes, mats[i].row_bytes);
  }
  if (zero_points) block_sums(x, m, k, xsum2);
  const int p = path();
  const int lanes = p == PATH_AVX512 ? 16 : 8;
  const int64_t ldxp = xp_stride(nb, lanes);
  thread_local std::vector<float> xp, xk;  // rows_avx2_q4's and Q4_K's x, per calling thread (workers only read)
  for (int64_t m0 = 0; m0 < m; m0 += 64) {  // 64 activation rows at a time keep x in L2 while w streams
    const int mm = static_cast<int>(m - m0 < 64 ? m - m0 : 64);
    if (q4 && p >= PATH_AVX2) {
      xp.resize(mm * ldxp);
      permute_x(x + m0 * k, mm, k, k, xp.data(), ldxp, lanes, 4);
    }
    if (q4k && p >= PATH_AVX2) {
      xk.resize(mm * k);
      permute_x(x + m0 * k, mm, k, k, xk.data(), k, lanes, 8);  // k is whole super-blocks: no padding
    }
    // a thread_local named inside the lambda would be each worker's own (empty) one
    const float *xpp = xp.data(), *xkp = xk.data();
    // grain: enough rows that a task streams >= ~16 KB of weights, at least 8 rows
    const int64_t grain = std::max<int64_t>(8, 16384 / (max_row_bytes * std::min(mm, 4)));
    const auto work = [&](int64_t b, int64_t e) {
      int64_t base = 0;
      for (int i = 0; i < count; ++i) {
        const MatRef& mr = mats[i];
        const int64_t lo = std::max(b, base), hi = std::min(e, base + mr.n);
        if (lo < hi) {
          const Job j{x + m0 * k, k, xsum2 + m0 * nb * 2, mr.w, mr.row_bytes, mm, k, mr.qtype, mr.y + m0 * mr.n, mr.n,
                      xpp, ldxp, xkp};
          run_rows(j, lo - base, hi - base, p);
        }
        base += mr.n;
      }
    };
    at::parallel_for(0, total, grain, work);
  }
}

// y (m, n) = x (m, k) @ dequant(w (n, row_bytes))^T; xsum2 (m, k/32, 2) scratch
void qmatmul_raw(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes, int qtype,
                 float* xsum2, float* y) {
  const MatRef r{w, n, row_bytes, qtype, y};
  qmatmul_multi(x, m, k, &r, 1, xsum2);
}

}  // namespace wq
