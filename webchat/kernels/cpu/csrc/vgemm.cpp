// The vision encoder's exact GEMM on AMX (docs/vision.md): y = x W^T in float32 from bfloat16 pieces.
//
//   w = wh + wl exactly (an F16 or BF16 weight: 11 significant bits, 8 in wh and the rest in wl)
//   x = xh + xl + r, xh = bf16(x), xl = bf16(x - xh), |r| <= 2^-17 |x|
//   y = xh wh + xh wl + xl wh          (dropped: r w and xl wl, each at most ~2^-17 |x w|)
//
// Three bfloat16 products accumulated in float32 by AMX (TDPBF16PS) through torch's oneDNN brgemm: about 1e-5
// relative to the float32 product, within float rounding of a 3072-term sum, at a third of the sgemm's time where
// AMX runs (measured in docs/vision.md). Tasks are (64-row block, 64-column panel), rows-major, over
// at::parallel_for; each thread releases AMX's tile state when its share is done.
#include "vgemm.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "qcommon.h"

namespace wq {

namespace {

constexpr int64_t VG_MB = 128;  // x rows a brgemm call (measured 64 / 128 / 256: 128 the fastest by a little)

inline uint16_t bf16_bits(float f) {  // round to nearest even, as c10::BFloat16 does (no NaN here: weights, activations)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

inline float bf16_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// hi[i] = bf16(x[i]), lo[i] = bf16(x[i] - hi[i]) for i in [b, e): 16 at a time with vcvtneps2bf16 (the same rounding,
// to nearest even; AMX's CPUs have AVX512-BF16), the rest one by one
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void split_avx512(const float* x, int64_t b,
                                                                                   int64_t e, uint16_t* hi,
                                                                                   uint16_t* lo) {
  int64_t i = b;
  for (; i + 16 <= e; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
  }
  for (; i < e; ++i) hi[i] = bf16_bits(x[i]), lo[i] = bf16_bits(x[i] - bf16_float(hi[i]));
}

void split_rows(const float* x, int64_t count, uint16_t* hi, uint16_t* lo) {
  static const bool wide = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  at::parallel_for(0, count, 16384, [&](int64_t b, int64_t e) {
    if (wide) return split_avx512(x, b, e, hi, lo);
    for (int64_t i = b; i < e; ++i) hi[i] = bf16_bits(x[i]), lo[i] = bf16_bits(x[i] - bf16_float(hi[i]));
  });
}

// x = x/2 (1 + tanh(a)), a = sqrt(2/pi) (x + 0.044715 x^3), tanh(a) = 1 - 2 / (e^(2a) + 1), for x[b, e)
__attribute__((target("avx512f"))) void gelu_avx512(float* x, int64_t b, int64_t e) {
  const __m512 c = _mm512_set1_ps(0.7978845608028654f), k = _mm512_set1_ps(0.044715f), one = _mm512_set1_ps(1.f);
  const __m512 two = _mm512_set1_ps(2.f), half = _mm512_set1_ps(0.5f);
  int64_t i = b;
  for (; i + 16 <= e; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 a = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(k, v), _mm512_mul_ps(v, v), v));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(exp512(_mm512_mul_ps(two, a)), one)));
    _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_mul_ps(half, v), _mm512_add_ps(one, t)));
  }
  for (; i < e; ++i) {
    const float a = 0.7978845608028654f * (x[i] + 0.044715f * x[i] * x[i] * x[i]);
    x[i] = 0.5f * x[i] * (1.f + std::tanh(a));
  }
}

}  // namespace

bool gelu_wide() {
  static const bool wide = __builtin_cpu_supports("avx512f");
  return wide;
}

void gelu_span(float* x, int64_t n) {
  if (gelu_wide()) return gelu_avx512(x, 0, n);
  for (int64_t i = 0; i < n; ++i)
    x[i] = 0.5f * x[i] * (1.f + std::tanh(0.7978845608028654f * (x[i] + 0.044715f * x[i] * x[i] * x[i])));
}

bool amx_bf16() {
  static const bool ok = at::native::cpublas::could_pack(at::kBFloat16) && at::cpu::init_amx();
  return ok;
}

bool split_pack(const torch::Tensor& w, SplitMat& m) {
  if (w.dim() != 2 || w.scalar_type() != torch::kFloat32 || !w.is_contiguous() || w.size(1) % 2 != 0) return false;
  const int64_t n = w.size(0), K = w.size(1), panels = (n + VG_NB - 1) / VG_NB;
  torch::Tensor hi_t = torch::empty({panels, K * VG_NB}, torch::kBFloat16);
  torch::Tensor lo_t = torch::empty({panels, K * VG_NB}, torch::kBFloat16);
  // brgemm's packed bfloat16 B (oneDNN's VNNI form, as cpublas::pack lays it out): a panel's (k, 64) matrix as pairs
  // of k, element (kk, j) at (kk / 2) * 128 + 2 j + kk % 2; columns past n are zeros. Written pair by pair (the
  // writes in order, the reads from the panel's 64 rows in L1)
  const float* x = w.data_ptr<float>();
  auto* hi = reinterpret_cast<uint16_t*>(hi_t.data_ptr());
  auto* lo = reinterpret_cast<uint16_t*>(lo_t.data_ptr());
  std::atomic<bool> exact{true};
  at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
    bool ok = true;
    for (int64_t p = b; p < e; ++p) {
      const int64_t rows = std::min(VG_NB, n - p * VG_NB);
      uint16_t *ph = hi + p * K * VG_NB, *pl = lo + p * K * VG_NB;
      for (int64_t q = 0; q < K / 2; ++q) {
        uint16_t *oh = ph + q * 2 * VG_NB, *ol = pl + q * 2 * VG_NB;
        for (int64_t j = 0; j < VG_NB; ++j)
          for (int64_t t = 0; t < 2; ++t) {
            const float v = j < rows ? x[(p * VG_NB + j) * K + 2 * q + t] : 0.f;
            const uint16_t h = bf16_bits(v), l = bf16_bits(v - bf16_float(h));
            oh[2 * j + t] = h, ol[2 * j + t] = l;
            ok &= bf16_float(h) + bf16_float(l) == v;
          }
      }
    }
    if (!ok) exact = false;
  });
  if (!exact) return false;
  m.n = n, m.k = K, m.hi = hi_t, m.lo = lo_t;
  return true;
}

void split_gemm(const float* x, int64_t M, const SplitMat& m, const float* bias, float* y, bool gelu) {
  const int64_t K = m.k, panels = m.hi.size(0), blocks = (M + VG_MB - 1) / VG_MB;
  const torch::Tensor xh = torch::empty({M * K}, torch::kBFloat16), xl = torch::empty({M * K}, torch::kBFloat16);
  const auto* ah = xh.data_ptr<at::BFloat16>();
  const auto* al = xl.data_ptr<at::BFloat16>();
  split_rows(x, M * K, reinterpret_cast<uint16_t*>(xh.data_ptr()), reinterpret_cast<uint16_t*>(xl.data_ptr()));
  const auto* wh = m.hi.data_ptr<at::BFloat16>();
  const auto* wl = m.lo.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks * panels, 1, [&](int64_t b, int64_t e) {
    std::vector<float> c(VG_MB * VG_NB);
    for (int64_t t = b; t < e; ++t) {
      const int64_t r0 = t / panels * VG_MB, p = t % panels, rows = std::min(VG_MB, M - r0);
      const int64_t n0 = p * VG_NB, cols = std::min(VG_NB, m.n - n0);
      const at::BFloat16 *bh = wh + p * K * VG_NB, *bl = wl + p * K * VG_NB;
      at::native::cpublas::brgemm(rows, VG_NB, K, K, VG_NB, VG_NB, false, ah + r0 * K, bh, c.data());
      at::native::cpublas::brgemm(rows, VG_NB, K, K, VG_NB, VG_NB, true, ah + r0 * K, bl, c.data());
      at::native::cpublas::brgemm(rows, VG_NB, K, K, VG_NB, VG_NB, true, al + r0 * K, bh, c.data());
      for (int64_t r = 0; r < rows; ++r) {
        float* out = y + (r0 + r) * m.n + n0;
        const float* src = c.data() + r * VG_NB;
        if (bias != nullptr) {
          for (int64_t j = 0; j < cols; ++j) out[j] = src[j] + bias[n0 + j];
        } else {
          std::copy(src, src + cols, out);
        }
        if (gelu) gelu_span(out, cols);  // while the tile is in cache: one pass over the (M, n) output saved
      }
    }
    at::native::cpublas::brgemm_release();
  });
}

}  // namespace wq
