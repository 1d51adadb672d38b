// The 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against int8 activations (qint8.h, docs/quant.md).
//
//   y = sum_b sum_c d_w,b d_x,c (sum_{i in c} w_i q_i) [+ m_w,b s_x,b],  c: the block's 8-value groups,
//   w_i: Q4_0 q - 8, Q4_1 q, Q5_0 q - 16, Q5_1 q, Q8_0 q
//
// Three paths give the same bits: the integer sums are exact, and every path takes the float steps of
// qint8_blocks.inc in the same order (the scalar path lane by lane, std::fma). AVX2: vpmaddubsw + vpmaddwd;
// VNNI (AVX-VNNI, or AVX-512 VNNI + VL): one vpdpbusd for the pair, the same sums (no product pair reaches the
// int16 saturation maddubs could meet: |w| <= 128, |q| <= 127).
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "qint8.h"
#include "qkblocks.h"

namespace wq {

namespace {

int g_vnni = -1;  // -1: not chosen yet; 0: off; 1: AVX-VNNI; 2: AVX-512 VNNI (256-bit forms)

// where a CPU has both (Sapphire Rapids, Zen 5), AVX-512 VNNI's 256-bit forms: 32 registers (the packed Q4_K prompt
// tiles 6 x rows by 2 groups against AVX-VNNI's 2 by 2: 10-15% faster there at 8 to 256 rows) and the x word as an
// embedded broadcast
int cpu_vnni() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) return 2;
  if (__builtin_cpu_supports("avxvnni")) return 1;
  return 0;
}

// ---------------------------------------------------------------- scalar: the order every path follows
// block b's weights as signed integers in value order
template <int QT>
void block_ints(const uint8_t* blk, int w[32]) {
  if (QT == Q8_0) {
    for (int i = 0; i < 32; ++i) w[i] = static_cast<int8_t>(blk[2 + i]);
    return;
  }
  constexpr bool Q5 = QT == Q5_0 || QT == Q5_1;
  constexpr int QOFF = QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : QT == Q5_1 ? 8 : 2;
  constexpr int ZERO = QT == Q4_0 ? 8 : QT == Q5_0 ? 16 : 0;
  uint32_t qh = 0;
  if (Q5) std::memcpy(&qh, blk + QOFF - 4, 4);
  for (int i = 0; i < 16; ++i) {
    w[i] = (blk[QOFF + i] & 15) + (Q5 ? ((qh >> i) & 1) << 4 : 0) - ZERO;
    w[i + 16] = (blk[QOFF + i] >> 4) + (Q5 ? ((qh >> (i + 16)) & 1) << 4 : 0) - ZERO;
  }
}

template <int QT>
void rows_scalar(const Job8& j, int64_t n0, int64_t n1) {
  constexpr int64_t BB = BlockOf<QT>::bytes;
  constexpr bool MIN = QT == Q4_1 || QT == Q5_1;
  const int64_t nb = j.k / 32, ldb = j.a->ldb;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    for (int r = 0; r < j.m; ++r) {
      const int64_t xr = j.r0 + r;
      const int8_t* q = j.a->qb.data() + xr * j.k;
      const float* d8 = j.a->d8.data() + xr * j.k / 4;
      float acc[8] = {}, macc[8] = {};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * BB;
        int w[32];
        block_ints<QT>(blk, w);
        const float dw = half_to_float(blk);
        for (int l = 0; l < 8; ++l) {
          int32_t isum = 0;
          for (int i = 4 * l; i < 4 * l + 4; ++i) isum += w[i] * q[32 * b + i];
          acc[l] = std::fma(dw * d8[8 * b + l], static_cast<float>(isum), acc[l]);
        }
        if (MIN) macc[b % 8] = std::fma(half_to_float(blk + 2), j.a->s[xr * ldb + b], macc[b % 8]);
      }
      j.y[r * j.ldy + n] = MIN ? hsum8(acc) + hsum8(macc) : hsum8(acc);
    }
  }
}

// ---------------------------------------------------------------- vector paths
#define I8_AVX2 __attribute__((target("avx2,fma,f16c")))

// the float16 scales (d) of nbg blocks of BB bytes from p, and their zero points (m, the next half), as 8 halves each;
// zeros past nbg. Built in general registers (a vector load of narrow stores would stall on store forwarding), a
// whole group without a loop.
template <int64_t BB>
inline uint64_t four_halves(const uint8_t* p) {
  uint16_t h[4];
  for (int i = 0; i < 4; ++i) std::memcpy(&h[i], p + i * BB, 2);
  return uint64_t(h[0]) | uint64_t(h[1]) << 16 | uint64_t(h[2]) << 32 | uint64_t(h[3]) << 48;
}

template <int64_t BB, bool MIN>
I8_AVX2 inline void group_halves(const uint8_t* p, int nbg, __m128i* d, __m128i* m) {
  if (nbg == 8) {
    *d = _mm_set_epi64x(static_cast<int64_t>(four_halves<BB>(p + 4 * BB)), static_cast<int64_t>(four_halves<BB>(p)));
    if (MIN)
      *m = _mm_set_epi64x(static_cast<int64_t>(four_halves<BB>(p + 4 * BB + 2)),
                          static_cast<int64_t>(four_halves<BB>(p + 2)));
    return;
  }
  uint64_t d0 = 0, d1 = 0, m0 = 0, m1 = 0;  // a last, short group: the same in general registers, block by block
  for (int b = 0; b < nbg; ++b) {
    uint16_t h[2];
    std::memcpy(h, p + b * BB, MIN ? 4 : 2);
    const int shift = 16 * (b % 4);
    (b < 4 ? d0 : d1) |= uint64_t(h[0]) << shift;
    if (MIN) (b < 4 ? m0 : m1) |= uint64_t(h[1]) << shift;
  }
  *d = _mm_set_epi64x(static_cast<int64_t>(d1), static_cast<int64_t>(d0));
  *m = _mm_set_epi64x(static_cast<int64_t>(m1), static_cast<int64_t>(m0));
}

// byte i = ((qh >> i) & 1) << 4
I8_AVX2 inline __m256i fifth_bits(uint32_t qh) {
  const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), spread), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

// the block's 32 weight integers as bytes in value order (signed where the format is: Q4_0, Q5_0, Q8_0)
template <int QT>
I8_AVX2 inline __m256i block_bytes_avx2(const uint8_t* blk) {
  if (QT == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  constexpr int QOFF = QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : QT == Q5_1 ? 8 : 2;
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + QOFF));
  __m256i v = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1),
                               _mm256_set1_epi8(15));
  if (QT == Q5_0 || QT == Q5_1) {
    uint32_t qh;
    std::memcpy(&qh, blk + QOFF - 4, 4);
    v = _mm256_or_si256(v, fifth_bits(qh));
  }
  if (QT == Q4_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
  if (QT == Q5_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
  return v;
}

#define I8_NAME rows_avx2
#define I8_TARGET I8_AVX2
#define I8_DOT(a, b) _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones)
#include "qint8_blocks.inc"
#undef I8_NAME
#undef I8_TARGET
#undef I8_DOT

#define I8_NAME rows_avxvnni
#define I8_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define I8_DOT(a, b) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b)
#include "qint8_blocks.inc"
#undef I8_NAME
#undef I8_TARGET
#undef I8_DOT

#define I8_NAME rows_avx512vnni
#define I8_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define I8_DOT(a, b) _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b)
#include "qint8_blocks.inc"
#undef I8_NAME
#undef I8_TARGET
#undef I8_DOT

using Rows8 = void (*)(const Job8&, int, int64_t, int64_t);

template <int QT>
void rows_vector(const Job8& j, int64_t n0, int64_t n1) {
  static constexpr Rows8 TABLE[3][4] = {
      {rows_avx2<QT, 1>, rows_avx2<QT, 2>, rows_avx2<QT, 3>, rows_avx2<QT, 4>},
      {rows_avxvnni<QT, 1>, rows_avxvnni<QT, 2>, rows_avxvnni<QT, 3>, rows_avxvnni<QT, 4>},
      {rows_avx512vnni<QT, 1>, rows_avx512vnni<QT, 2>, rows_avx512vnni<QT, 3>, rows_avx512vnni<QT, 4>},
  };
  const Rows8* fns = TABLE[vnni_kind()];
  for (int64_t t0 = n0; t0 < n1; t0 += 16) {  // 16 weight rows stay in L1 while every group of 4 x rows passes
    const int64_t t1 = t0 + 16 < n1 ? t0 + 16 : n1;
    for (int r0 = 0; r0 < j.m; r0 += 4) fns[(j.m - r0 < 4 ? j.m - r0 : 4) - 1](j, r0, t0, t1);
  }
}

}  // namespace

bool vnni512(int p) { return p >= PATH_AVX512 && vnni_kind() == 2; }  // the path has BW, kind 2 VNNI and VL

int vnni_kind() {
  if (g_vnni < 0) g_vnni = cpu_vnni();
  return g_vnni;
}

bool vnni() { return vnni_kind() > 0; }

int set_vnni(int on) {
  const int cpu = cpu_vnni();
  TORCH_CHECK(on >= -1 && on <= 2, "vnni must be -1 (where the CPU has it), 0, 1 or 2 (AVX-VNNI's forms), got ", on);
  TORCH_CHECK(on != 1 || cpu > 0, "this CPU has neither AVX-VNNI nor AVX-512 VNNI");
  TORCH_CHECK(on != 2 || __builtin_cpu_supports("avxvnni"), "this CPU has no AVX-VNNI");
  g_vnni = on < 0 ? cpu : on == 0 ? 0 : on == 1 ? cpu : 1;
  return g_vnni > 0;
}

void blocks8_rows(const Job8& j, int64_t n0, int64_t n1, int p) {
  const bool vec = p >= PATH_AVX2;
  switch (j.qtype) {
    case Q4_0: return vec ? rows_vector<Q4_0>(j, n0, n1) : rows_scalar<Q4_0>(j, n0, n1);
    case Q4_1: return vec ? rows_vector<Q4_1>(j, n0, n1) : rows_scalar<Q4_1>(j, n0, n1);
    case Q5_0: return vec ? rows_vector<Q5_0>(j, n0, n1) : rows_scalar<Q5_0>(j, n0, n1);
    case Q5_1: return vec ? rows_vector<Q5_1>(j, n0, n1) : rows_scalar<Q5_1>(j, n0, n1);
    case Q8_0: return vec ? rows_vector<Q8_0>(j, n0, n1) : rows_scalar<Q8_0>(j, n0, n1);
    default: TORCH_CHECK(false, "no int8 kernel for ggml type ", j.qtype, " among the 32-value formats");
  }
}

}  // namespace wq
