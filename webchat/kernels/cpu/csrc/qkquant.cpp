// Q4_K, Q5_K and Q6_K (ggml's 256-value super-blocks) on the CPU: dequantization and y = x @ dequant(w)^T (+ bias).
// Registered as torch ops (torch.ops.webchat_kq.matmul / .dequantize) so this file needs no binding elsewhere.
//   Q4_K block (144 B): d, dmin (f16), scales[12] (eight 6-bit scale/min pairs), qs[128] (4-bit);
//                      w = d * sc_j * q - dmin * m_j for sub-block j of 32
//   Q5_K block (176 B): d, dmin, scales[12] as Q4_K, qh[32] (bit j of qh[l]: the fifth bit of value l of sub-block j),
//                      qs[128]; w = d * sc_j * q - dmin * m_j, q of 5 bits
//   Q6_K block (210 B): ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d (f16);
//                      w = d * sc_g * (q - 32) for group g of 16
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstdint>

#include "qcommon.h"
#include "qkblocks.h"

namespace wq {
namespace {

constexpr int64_t QK = 256;
// Q4_K = 12, Q6_K = 14: ggml's type numbers (qcommon.h)

int64_t kblock_bytes(int64_t qtype) { return qtype == Q4_K ? 144 : qtype == Q5_K ? 176 : qtype == Q6_K ? 210 : 0; }

// the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4)
inline void scale_min(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#define KQ_CLONES __attribute__((target_clones("arch=haswell", "default")))  // AVX2+FMA where the CPU has it

// y[256] of one block; loops over runs of 16 or 32 values under one scale, so they vectorise
KQ_CLONES void dequant_q4_k(const uint8_t* b, float* y) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* s = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0; j < 4; ++j) {  // 64 values: low nibbles are sub-block 2j, high nibbles 2j + 1
    int sc1, m1, sc2, m2;
    scale_min(2 * j, s, &sc1, &m1);
    scale_min(2 * j + 1, s, &sc2, &m2);
    const float d1 = d * float(sc1), n1 = dmin * float(m1), d2 = d * float(sc2), n2 = dmin * float(m2);
    for (int l = 0; l < 32; ++l) y[64 * j + l] = d1 * float(q[32 * j + l] & 0xF) - n1;
    for (int l = 0; l < 32; ++l) y[64 * j + 32 + l] = d2 * float(q[32 * j + l] >> 4) - n2;
  }
}

KQ_CLONES void dequant_q5_k(const uint8_t* b, float* y) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* s = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + 48;
  for (int j = 0; j < 4; ++j) {  // 64 values: low nibbles (and qh bit 2j) sub-block 2j, high nibbles (bit 2j + 1) 2j + 1
    int sc1, m1, sc2, m2;
    scale_min(2 * j, s, &sc1, &m1);
    scale_min(2 * j + 1, s, &sc2, &m2);
    const float d1 = d * float(sc1), n1 = dmin * float(m1), d2 = d * float(sc2), n2 = dmin * float(m2);
    for (int l = 0; l < 32; ++l) y[64 * j + l] = d1 * float((q[32 * j + l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4)) - n1;
    for (int l = 0; l < 32; ++l)
      y[64 * j + 32 + l] = d2 * float((q[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) - n2;
  }
}

KQ_CLONES void dequant_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int is = 0; is < 2; ++is) {  // values l in [16 is, 16 is + 16) of each quarter share scale sc[is + 2 quarter]
      const float d1 = d * float(sc[is]), d2 = d * float(sc[is + 2]), d3 = d * float(sc[is + 4]);
      const float d4 = d * float(sc[is + 6]);
      for (int l = 16 * is; l < 16 * is + 16; ++l) {
        y[l] = d1 * float(int((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
        y[l + 32] = d2 * float(int((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
        y[l + 64] = d3 * float(int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        y[l + 96] = d4 * float(int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
  }
}

// The same values 16 at a time on AVX-512 (a prompt's GEMM dequantizes every weight tile it uses, qgemm.cpp). Every
// product here is exact (d is a half, 11 bits; a scale 6 or 8 bits; q 4 or 6 bits: at most 24 bits), so the loops
// above, vectorised with or without FMA, and these give the same floats.
#define KQ_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))

KQ_AVX512 inline __m512 bytes16(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }

KQ_AVX512 void dequant_q4_k_avx512(const uint8_t* b, float* y) {
  const float d = half_f16c(b), dmin = half_f16c(b + 2);
  const uint8_t* q = b + 16;
  const __m128i low = _mm_set1_epi8(15);
  for (int j = 0; j < 4; ++j) {  // 64 values: low nibbles are sub-block 2j, high nibbles 2j + 1
    int sc1, m1, sc2, m2;
    scale_min(2 * j, b + 4, &sc1, &m1);
    scale_min(2 * j + 1, b + 4, &sc2, &m2);
    const __m512 d1 = _mm512_set1_ps(d * float(sc1)), n1 = _mm512_set1_ps(dmin * float(m1));
    const __m512 d2 = _mm512_set1_ps(d * float(sc2)), n2 = _mm512_set1_ps(dmin * float(m2));
    for (int h = 0; h < 2; ++h) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * j + 16 * h));
      _mm512_storeu_ps(y + 64 * j + 16 * h, _mm512_sub_ps(_mm512_mul_ps(d1, bytes16(_mm_and_si128(v, low))), n1));
      _mm512_storeu_ps(y + 64 * j + 32 + 16 * h,
                       _mm512_sub_ps(_mm512_mul_ps(d2, bytes16(_mm_and_si128(_mm_srli_epi16(v, 4), low))), n2));
    }
  }
}

KQ_AVX512 void dequant_q6_k_avx512(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_f16c(b + 208);
  const __m512i off = _mm512_set1_epi32(32);
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32, sc += 8, y += 128) {
    __m256i q[4];
    q6_quarters(ql, qh, q);
    for (int quarter = 0; quarter < 4; ++quarter) {
      for (int is = 0; is < 2; ++is) {  // values [16 is, 16 is + 16) of a quarter share scale sc[is + 2 quarter]
        const __m128i v = is ? _mm256_extracti128_si256(q[quarter], 1) : _mm256_castsi256_si128(q[quarter]);
        const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(v), off));
        _mm512_storeu_ps(y + 32 * quarter + 16 * is,
                         _mm512_mul_ps(_mm512_set1_ps(d * float(sc[is + 2 * quarter])), f));
      }
    }
  }
}

// avx512: path() is PATH_AVX512 (WEBCHAT_QPATH and set_path choose it, as for every other kernel)
inline void dequant_block(int64_t qtype, const uint8_t* b, float* y, bool avx512) {
  if (qtype == Q5_K) {  // one form for every path (its products are exact too)
    dequant_q5_k(b, y);
  } else if (qtype == Q4_K) {
    avx512 ? dequant_q4_k_avx512(b, y) : dequant_q4_k(b, y);
  } else {
    avx512 ? dequant_q6_k_avx512(b, y) : dequant_q6_k(b, y);
  }
}

// The matmul works on int8 quants and per-group float scales: Q4_K groups of 32 (q 0..15, minus dmin m_j times the
// group's sum of x, precomputed), Q6_K groups of 16 (q - 32). Unpacking is byte arithmetic in contiguous loops.
struct Unpacked {
  alignas(32) int8_t q[QK];
  float scale[16];  // per group: d * sc
  float minus[8];  // Q4_K per group of 32: dmin * m
};

KQ_CLONES void unpack_q4_k(const uint8_t* b, Unpacked* u) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* q = b + 16;
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) u->q[64 * j + l] = int8_t(q[32 * j + l] & 0xF);
    for (int l = 0; l < 32; ++l) u->q[64 * j + 32 + l] = int8_t(q[32 * j + l] >> 4);
  }
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min(j, b + 4, &sc, &mn);
    u->scale[j] = d * float(sc);
    u->minus[j] = dmin * float(mn);
  }
}

KQ_CLONES void unpack_q5_k(const uint8_t* b, Unpacked* u) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + 48;
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) u->q[64 * j + l] = int8_t((q[32 * j + l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4));
    for (int l = 0; l < 32; ++l)
      u->q[64 * j + 32 + l] = int8_t((q[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
  }
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min(j, b + 4, &sc, &mn);
    u->scale[j] = d * float(sc);
    u->minus[j] = dmin * float(mn);
  }
}

KQ_CLONES void unpack_q6_k(const uint8_t* b, Unpacked* u) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32) {
    int8_t* q = u->q + 128 * h;
    for (int l = 0; l < 32; ++l) q[l] = int8_t(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
    for (int l = 0; l < 32; ++l) q[l + 32] = int8_t(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
    for (int l = 0; l < 32; ++l) q[l + 64] = int8_t(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
    for (int l = 0; l < 32; ++l) q[l + 96] = int8_t(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
  }
  for (int g = 0; g < 16; ++g) u->scale[g] = d * float(sc[g]);
}

// sum_g scale[g] * (q_g . x_g) over the block's 256 values, groups of G
template <int G>
float qdot_scalar(const Unpacked& u, const float* x) {
  float total = 0.f;
  for (int g = 0; g < QK / G; ++g) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < G; i += 8)
      for (int t = 0; t < 8; ++t) acc[t] += float(u.q[g * G + i + t]) * x[g * G + i + t];
    total += u.scale[g] * (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])));
  }
  return total;
}

template <int G>
__attribute__((target("avx2,fma"))) float qdot_avx2(const Unpacked& u, const float* x) {
  __m256 total = _mm256_setzero_ps();
  for (int g = 0; g < QK / G; ++g) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < G; i += 8) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u.q + g * G + i));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), _mm256_loadu_ps(x + g * G + i), acc);
    }
    total = _mm256_fmadd_ps(_mm256_set1_ps(u.scale[g]), acc, total);
  }
  return hsum256(total);
}

// y[i * ldy] += block . x[i] for m rows of x (stride ldx); xsum: the sums of x per 32 values (Q4_K's mins), row i's
// group j at xsum[i * lds + j * js]
void block_dot(int64_t qtype, const uint8_t* b, const float* x, int64_t ldx, const float* xsum, int64_t lds,
               int64_t m, float* y, int64_t ldy, bool avx2, int64_t js = 1) {
  Unpacked u;
  if (qtype == Q4_K) {
    unpack_q4_k(b, &u);
  } else if (qtype == Q5_K) {
    unpack_q5_k(b, &u);
  } else {
    unpack_q6_k(b, &u);
  }
  for (int64_t i = 0; i < m; ++i) {
    const float* xr = x + i * ldx;
    float s;
    if (qtype != Q6_K) {  // Q4_K, Q5_K: groups of 32 with mins
      s = avx2 ? qdot_avx2<32>(u, xr) : qdot_scalar<32>(u, xr);
      for (int j = 0; j < 8; ++j) s -= u.minus[j] * xsum[i * lds + j * js];
    } else {
      s = avx2 ? qdot_avx2<16>(u, xr) : qdot_scalar<16>(u, xr);
    }
    y[i * ldy] += s;
  }
}

void check(const torch::Tensor& w, int64_t qtype, int64_t k) {
  const int64_t bb = kblock_bytes(qtype);
  TORCH_CHECK(bb > 0, "qtype must be 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K), got ", qtype);
  TORCH_CHECK(k > 0 && k % QK == 0, "K must be a positive multiple of 256 (the super-block), got ", k);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.device().is_cpu() && w.is_contiguous(),
              "w must be a contiguous 2-D uint8 CPU tensor, got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(w.size(1) == k / QK * bb, "w rows must hold ", k / QK * bb, " bytes for K=", k, ", got ", w.size(1));
}

// float32 (N, K) of the blocks w (N, K / 256 * block bytes)
torch::Tensor kq_dequantize(const torch::Tensor& w, int64_t qtype, int64_t k) {
  check(w, qtype, k);
  const int64_t n = w.size(0), rb = w.size(1), bb = kblock_bytes(qtype);
  torch::Tensor y = torch::empty({n, k}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const bool avx512 = path() == PATH_AVX512;
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      for (int64_t b = 0; b < k / QK; ++b) dequant_block(qtype, wp + r * rb + b * bb, yp + r * k + b * QK, avx512);
  });
  return y;
}

// y (M, N) = x (M, K) @ dequant(w)^T [+ bias]: each block unpacked once to int8, dotted with every x row by group
// (AVX2+FMA where path() allows it, WEBCHAT_QPATH=scalar forces the portable loop)
torch::Tensor kq_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t k,
                        const std::optional<torch::Tensor>& bias) {
  check(w, qtype, k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be (M, ", k, "), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu(), "x must be float32 on the CPU, got ",
              x.scalar_type(), " on ", x.device());
  const torch::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), n = w.size(0), rb = w.size(1), bb = kblock_bytes(qtype);
  torch::Tensor y = torch::zeros({m, n}, xc.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ng = k / 32;
  torch::Tensor xsum = xc.view({m, ng, 32}).sum(-1).contiguous();  // (M, K / 32)
  const float* sp = xsum.data_ptr<float>();
  const bool avx2 = path() >= PATH_AVX2;
  at::parallel_for(0, n, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      for (int64_t b = 0; b < k / QK; ++b)
        block_dot(qtype, wp + r * rb + b * bb, xp + b * QK, k, sp + b * 8, ng, m, yp + r, n, avx2);
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace

namespace {

__attribute__((target("avx2,fma,f16c"))) inline __m256 widen8(const uint8_t* b8) {  // 8 bytes as 8 floats
  int64_t v;
  std::memcpy(&v, b8, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v)));
}

// (d * sc_g) and (dmin * m_g), g < 8, as two vectors of 8
__attribute__((target("avx2,fma,f16c"))) inline void k4_scales(const uint8_t* blk, __m256* sc, __m256* mn) {
  uint8_t s8[8], m8[8];
  scales_mins_k4(blk + 4, s8, m8);
  int32_t raw_dm;
  std::memcpy(&raw_dm, blk, 4);
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(raw_dm));  // (d, dmin) in lanes 0, 1
  *sc = _mm256_mul_ps(widen8(s8), _mm256_broadcastss_ps(dm));
  *mn = _mm256_mul_ps(widen8(m8), _mm256_broadcastss_ps(_mm_movehdup_ps(dm)));
}

// Q4_K rows straight from the nibbles, in Q4_1's form: per sub-block of 32, y += (d * sc_j) * (q . x) - (dmin * m_j)
// * sum(x), the products of a row kept in one vector across every block and summed once at its end; x's sums per 32
// come from the Job (qmatmul.cpp's block_sums), the mins against them in a vector of their own. The nibbles are
// masked where they lie, as qmatmul.cpp's rows_avx2_q4 does: 64 values (32 bytes) are 8 words of 8 nibbles,
// `word & (15 << 4v)` is q * 2^4v, one AND and one conversion for 8 weights. Even v are sub-block 2c (the low
// nibbles), odd v sub-block 2c + 1; row r of x comes in j.xk laid out to match, times 2^-4v (qmatmul.cpp's
// permute_x), so each product is exactly q * x.
template <int R>
__attribute__((target("avx2,fma,f16c"))) void q4k_rows_r(const Job& j, int r0, int64_t n0, int64_t n1) {
  const int64_t nsb = j.k / QK, nb = j.k / 32;
  const __m256i lo4 = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0), hi4 = _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    prefetch_ahead(row, j.row_bytes);
    __m256 acc[R], macc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
      const uint8_t* blk = row + b * 144;
      __m256 scv, mnv;
      k4_scales(blk, &scv, &mnv);
      alignas(32) float sc[8];
      _mm256_store_ps(sc, scv);
      // the mins in the odd lanes against xsum's (0, sum) pairs of the 8 sub-blocks
      const __m256 mlo = _mm256_permutevar8x32_ps(mnv, lo4), mhi = _mm256_permutevar8x32_ps(mnv, hi4);
      for (int r = 0; r < R; ++r) {
        const float* xs = j.xsum + (int64_t(r0 + r) * nb + b * 8) * 2;
        macc[r] = _mm256_fmadd_ps(mhi, _mm256_loadu_ps(xs + 8), _mm256_fmadd_ps(mlo, _mm256_loadu_ps(xs), macc[r]));
      }
      for (int c = 0; c < 4; ++c) {  // 64 values: sub-block 2c in the low nibbles of 32 bytes, 2c + 1 in the high
        const __m256i wd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
        const __m256 slo = _mm256_set1_ps(sc[2 * c]), shi = _mm256_set1_ps(sc[2 * c + 1]);
        __m256 plo[R], phi[R];
        {
          const __m256 w0 = nibble_at<0>(wd);
          const __m256 w1 = nibble_at<1>(wd);
          const __m256 w2 = nibble_at<2>(wd);
          const __m256 w3 = nibble_at<3>(wd);
          for (int r = 0; r < R; ++r) {
            const float* xb = j.xk + int64_t(r0 + r) * j.k + b * QK + 64 * c;
            plo[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), _mm256_mul_ps(w0, _mm256_loadu_ps(xb)));
            phi[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), _mm256_mul_ps(w1, _mm256_loadu_ps(xb + 8)));
          }
        }
        const __m256 w4 = nibble_at<4>(wd);
        const __m256 w5 = nibble_at<5>(wd);
        const __m256 w6 = nibble_at<6>(wd);
        const __m256 w7 = nibble_at<7>(wd);
        for (int r = 0; r < R; ++r) {
          const float* xb = j.xk + int64_t(r0 + r) * j.k + b * QK + 64 * c;
          plo[r] = _mm256_fmadd_ps(w6, _mm256_loadu_ps(xb + 48), _mm256_fmadd_ps(w4, _mm256_loadu_ps(xb + 32), plo[r]));
          phi[r] = _mm256_fmadd_ps(w7, _mm256_loadu_ps(xb + 56), _mm256_fmadd_ps(w5, _mm256_loadu_ps(xb + 40), phi[r]));
          acc[r] = _mm256_fmadd_ps(shi, phi[r], _mm256_fmadd_ps(slo, plo[r], acc[r]));
        }
      }
    }
    for (int r = 0; r < R; ++r) j.y[int64_t(r0 + r) * j.ldy + n] = hsum256(acc[r]) - hsum256(macc[r]);
  }
}

// The same at 16 lanes: a super-block's four 64-value chunks go two to a vector (lanes 0-7 chunk 2p, 8-15 chunk
// 2p + 1), so the scales are per half: (sc[4p] x8, sc[4p + 2] x8) for even v, (sc[4p + 1], sc[4p + 3]) for odd v;
// x laid out by permute_x with 16 lanes.
template <int R>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void q4k_rows_avx512(const Job& j, int r0, int64_t n0,
                                                                             int64_t n1) {
  const int64_t nsb = j.k / QK, nb = j.k / 32;
  const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  __m512i sel[4];  // pass p: even v, odd v
  for (int p = 0; p < 2; ++p)
    for (int odd = 0; odd < 2; ++odd)
      sel[2 * p + odd] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(4 * p + odd)),
                                            _mm256_set1_epi32(4 * p + 2 + odd), 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    prefetch_ahead(row, j.row_bytes);
    __m512 acc[R], macc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), macc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
      const uint8_t* blk = row + b * 144;
      __m256 scv, mnv;
      k4_scales(blk, &scv, &mnv);
      const __m512 sc16 = _mm512_castps256_ps512(scv);
      const __m512 m16 = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(mnv));
      for (int r = 0; r < R; ++r)
        macc[r] = _mm512_fmadd_ps(m16, _mm512_loadu_ps(j.xsum + (int64_t(r0 + r) * nb + b * 8) * 2), macc[r]);
      for (int p = 0; p < 2; ++p) {
        const __m512i wd = _mm512_loadu_si512(blk + 16 + 64 * p);
        const __m512 slo = _mm512_permutexvar_ps(sel[2 * p], sc16), shi = _mm512_permutexvar_ps(sel[2 * p + 1], sc16);
        __m512 plo[R], phi[R];
        {
          const __m512 w0 = nibble_at<0>(wd);
          const __m512 w1 = nibble_at<1>(wd);
          const __m512 w2 = nibble_at<2>(wd);
          const __m512 w3 = nibble_at<3>(wd);
          for (int r = 0; r < R; ++r) {
            const float* xb = j.xk + int64_t(r0 + r) * j.k + b * QK + 128 * p;
            plo[r] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xb + 32), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
            phi[r] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xb + 48), _mm512_mul_ps(w1, _mm512_loadu_ps(xb + 16)));
          }
        }
        const __m512 w4 = nibble_at<4>(wd);
        const __m512 w5 = nibble_at<5>(wd);
        const __m512 w6 = nibble_at<6>(wd);
        const __m512 w7 = nibble_at<7>(wd);
        for (int r = 0; r < R; ++r) {
          const float* xb = j.xk + int64_t(r0 + r) * j.k + b * QK + 128 * p;
          plo[r] = _mm512_fmadd_ps(w6, _mm512_loadu_ps(xb + 96), _mm512_fmadd_ps(w4, _mm512_loadu_ps(xb + 64), plo[r]));
          phi[r] = _mm512_fmadd_ps(w7, _mm512_loadu_ps(xb + 112), _mm512_fmadd_ps(w5, _mm512_loadu_ps(xb + 80), phi[r]));
          acc[r] = _mm512_fmadd_ps(shi, phi[r], _mm512_fmadd_ps(slo, plo[r], acc[r]));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      j.y[int64_t(r0 + r) * j.ldy + n] = _mm512_reduce_add_ps(acc[r]) - _mm512_reduce_add_ps(macc[r]);
  }
}

// Q6_K rows likewise: per group of 16, y += (d * sc_g) * ((q - 32) . x); 6-bit q from ql's nibble and qh's 2 bits,
// 32 at a time (q6_quarters)
template <int R>
__attribute__((target("avx2,fma,f16c"))) void q6k_rows_r(const Job& j, int r0, int64_t n0, int64_t n1) {
  const int64_t nsb = j.k / QK;
  const __m256i off = _mm256_set1_epi8(32);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    prefetch_ahead(row, j.row_bytes);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
      const uint8_t* blk = row + b * 210;
      const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
      uint16_t raw_d;
      std::memcpy(&raw_d, blk + 208, 2);
      const float d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(raw_d)));
      for (int h = 0; h < 2; ++h) {
        __m256i q[4];
        q6_quarters(blk + 64 * h, blk + 128 + 32 * h, q);
        for (int c = 0; c < 4; ++c) {  // 32 values, 128h + 32c: groups g and g + 1 of 16
          const __m256i qs = _mm256_sub_epi8(q[c], off);
          const __m128i a = _mm256_castsi256_si128(qs), e = _mm256_extracti128_si256(qs, 1);
          const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
          const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
          const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e));
          const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e, 8)));
          const int g = (128 * h + 32 * c) / 16;
          const __m256 s0 = _mm256_set1_ps(d * float(scales[g])), s1 = _mm256_set1_ps(d * float(scales[g + 1]));
          for (int r = 0; r < R; ++r) {
            const float* xb = j.x + int64_t(r0 + r) * j.ldx + b * QK + 128 * h + 32 * c;
            const __m256 p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), _mm256_mul_ps(w0, _mm256_loadu_ps(xb)));
            acc[r] = _mm256_fmadd_ps(s0, p, acc[r]);
            const __m256 p2 =
                _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), _mm256_mul_ps(w2, _mm256_loadu_ps(xb + 16)));
            acc[r] = _mm256_fmadd_ps(s1, p2, acc[r]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) j.y[int64_t(r0 + r) * j.ldy + n] = hsum256(acc[r]);
  }
}

using RowsFn = void (*)(const Job&, int, int64_t, int64_t);

// x rows 4, 2 or 1 at a time (each row's accumulator stays in a register): rows<4>, rows<2>, rows<1> of one kernel
void in_tiles(const Job& j, int64_t n0, int64_t n1, RowsFn by4, RowsFn by2, RowsFn by1) {
  for (int r0 = 0; r0 < j.m;) {
    const int left = j.m - r0, step = left >= 4 ? 4 : left >= 2 ? 2 : 1;
    (step == 4 ? by4 : step == 2 ? by2 : by1)(j, r0, n0, n1);
    r0 += step;
  }
}

}  // namespace

// The C++ forward's share (qmatmul_multi, qstep.cpp's embedding). On the scalar path the same block_dot per
// super-block as kq_matmul; on AVX2 q4k_rows_r / q6k_rows_r (x rows 4, 2 or 1 at a time; the same sums in another order: both
// within float32 rounding of x @ dequant(w)^T, tests/test_kquant.py).
int64_t kq_block_bytes(int qtype) { return kblock_bytes(qtype); }

void kq_rows(const Job& j, int64_t n0, int64_t n1, int p) {
  const int64_t bb = kblock_bytes(j.qtype), nb = j.k / 32;
  const bool avx2 = p >= PATH_AVX2;
  if (p == PATH_AVX512 && j.qtype == Q4_K)
    return in_tiles(j, n0, n1, q4k_rows_avx512<4>, q4k_rows_avx512<2>, q4k_rows_avx512<1>);
  if (avx2 && j.qtype == Q4_K) return in_tiles(j, n0, n1, q4k_rows_r<4>, q4k_rows_r<2>, q4k_rows_r<1>);
  if (avx2 && j.qtype == Q6_K) return in_tiles(j, n0, n1, q6k_rows_r<4>, q6k_rows_r<2>, q6k_rows_r<1>);
  for (int64_t r = n0; r < n1; ++r) {
    for (int i = 0; i < j.m; ++i) j.y[i * j.ldy + r] = 0.f;
    for (int64_t b = 0; b < j.k / QK; ++b)  // xsum: (m, k / 32, 2) pairs, the sum second (qmatmul.cpp's block_sums)
      block_dot(j.qtype, j.w + r * j.row_bytes + b * bb, j.x + b * QK, j.ldx, j.xsum + b * 16 + 1, 2 * nb, j.m,
                j.y + r, j.ldy, avx2, 2);
  }
}

void kq_dequant_row(int qtype, const uint8_t* row, int64_t k, float* out) {
  const int64_t bb = kblock_bytes(qtype);
  const bool avx512 = path() == PATH_AVX512;
  for (int64_t b = 0; b < k / QK; ++b) dequant_block(qtype, row + b * bb, out + b * QK, avx512);
}

}  // namespace wq

TORCH_LIBRARY(webchat_kq, m) {
  m.def("dequantize(Tensor w, int qtype, int k) -> Tensor", &wq::kq_dequantize);
  m.def("matmul(Tensor x, Tensor w, int qtype, int k, Tensor? bias) -> Tensor", &wq::kq_matmul);
}
