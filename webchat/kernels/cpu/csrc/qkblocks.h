// The K-quants' super-blocks as integers, shared by their kernels (qkquant.cpp: float32 activations; qint8k.cpp and
// qgemm8.cpp: int8 activations).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "qcommon.h"

namespace wq {

constexpr int64_t QK_K = 256;

template <int QT>
constexpr int64_t kbytes() {
  return QT == Q4_K ? 144 : QT == Q5_K ? 176 : 210;
}

// a super-block's 256 weight integers (Q6_K: q - 32), its 16 group scales (Q4_K/Q5_K: each sub-block's twice) and its
// 8 mins (Q4_K/Q5_K), in value order: ggml's dequantize_row_q4_K/q5_K/q6_K without the floats
template <int QT>
inline void super_ints(const uint8_t* blk, int w[QK_K], int sc[16], int mn[8]) {
  if (QT == Q6_K) {
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = blk + 64 * h;
      const uint8_t* qh = blk + 128 + 32 * h;
      for (int l = 0; l < 32; ++l) {
        w[128 * h + l] = ((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
        w[128 * h + 32 + l] = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
        w[128 * h + 64 + l] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        w[128 * h + 96 + l] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      }
    }
    for (int g = 0; g < 16; ++g) sc[g] = static_cast<int8_t>(blk[192 + g]);
    return;
  }
  uint8_t s8[8], m8[8];
  scales_mins_k4(blk + 4, s8, m8);
  const uint8_t* q = blk + (QT == Q4_K ? 16 : 48);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      const int hi0 = QT == Q5_K ? ((blk[16 + l] >> (2 * c)) & 1) << 4 : 0;
      const int hi1 = QT == Q5_K ? ((blk[16 + l] >> (2 * c + 1)) & 1) << 4 : 0;
      w[64 * c + l] = (q[32 * c + l] & 15) + hi0;
      w[64 * c + 32 + l] = (q[32 * c + l] >> 4) + hi1;
    }
  for (int v = 0; v < 8; ++v) sc[2 * v] = sc[2 * v + 1] = s8[v], mn[v] = m8[v];
}

// the sum of 8 lanes in hsum256's order: the scalar paths' last step
inline float hsum8(const float* v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

__attribute__((target("f16c"))) inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// A Q6_K half's 128 values as four 32-value quarters of 6-bit q, unsigned (ggml's layout: per half, q[l], q[l + 32],
// q[l + 64], q[l + 96] share ql[l], ql[l + 32] and qh[l]); the 16-bit shifts never carry a kept bit across a byte
// (masked first)
__attribute__((target("avx2"))) inline void q6_quarters(const uint8_t* ql, const uint8_t* qh, __m256i q[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
  q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
}

}  // namespace wq
