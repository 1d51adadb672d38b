// Weight rows packed 8 to a group for the int8 kernels (docs/quant.md, "Packed rows"): Q4_0, Q4_1, Q8_0 and the
// K-quants Q4_K, Q5_K, Q6_K.
//
// The row kernels (qint8.cpp, qint8k.cpp) take one weight row at a time: every 32 weights pay a scale shuffle, a
// vpmaddwd and a float step of their own, and every row a horizontal sum. Here 8 rows lie side by side, 4 bytes of
// each (ggml's Q4_0x8 / Q4_Kx8 idea, ggml-cpu/repack.cpp, with 4-byte words): one 4-byte word of the activation row,
// broadcast, meets the same word of 8 weight rows in one vpmaddubsw, the products add up in int16 over a scale's whole
// group, and a lane is one weight row to the end: the scales, the mins and the float steps go 8 rows a vector, and the
// 8 outputs leave in one store.
//
// The packing moves bytes and nothing else, in place (a group's 8 rows keep the bytes they had, in another order):
//   Q4_0 / Q4_1, per group and block of 32: the 8 rows' d (8 halves), Q4_1's m (8 halves), then for word c = 0..3 the
//     8 rows' bytes qs[4c .. 4c + 3] (low nibbles: values 4c .. 4c + 3, high: 16 + 4c ..)
//   Q4_K, per group and super-block: d (8 halves), dmin (8 halves), the 12 scale bytes as 3 words x 8 rows, then for
//     chunk c = 0..3 and word t = 0..7 the 8 rows' qs[32c + 4t .. + 3] (low nibbles: sub-block 2c, high: 2c + 1)
//   Q5_K, per group and super-block (1408 bytes): Q4_K's d, dmin and scale words, qh as 8 words x 8 rows (at 128),
//     then its qs as Q4_K's (at 384)
//   Q6_K, per group and super-block (1680 bytes): d (8 halves), the 16 scales a byte x 8 rows (group g's at 16 + 8g),
//     then per half h (at 144 + 768h) 8 words x 8 rows of ql[64h ..], of qh[32h ..] and of ql[64h + 32 ..]: sub-blocks
//     4h and 4h + 2 read the first and the second, 4h + 1 and 4h + 3 the second and the third
// so a packed matrix is as large as the file's, and unpacking gives the file's bytes back (tests/test_int8.py).
//
// Arithmetic (every path in this order, the scalar one with std::fma; the integers exact):
//   Q4_0 / Q4_1, per block b: I_g = sum_g q_w q_x over each 8-value group g of x (its scale d_x,g; q_w the unsigned
//     nibble), t = float(I_0) * d_x,0, t = fma(float(I_g), d_x,g, t) for g = 1 .. 3, acc = fma(t, d_w, acc) (one
//     multiply by d_w a block, where a multiply and an fma a group kept the vpdpbusd ports half busy); then
//     macc = fma(m_w, s_x,b, macc) with m_w = Q4_1's m or Q4_0's -8 d_w (w = q - 8); y = acc + macc
//   Q4_K, per super-block: for each half (sub-blocks 4h .. 4h + 3) I = sum_j sc_j p_j sum w q (int32: at most
//     4 * 63 * 128 * 32 * 15 * 127 < 2^31), acc = fma(float(I), d_w * dk, acc); msum = sum_j mn_j pq_j,
//     macc = fma(float(msum), dmin_w * dk, macc); y = acc - macc
//   Q5_K, per sub-block j: I = sc_j p_j sum w q (at most 63 * 128 * 32 * 31 * 127), acc = fma(float(I), d_w * dk, acc);
//     then acc = fma(-float(msum), dmin_w * dk, acc); y = acc: the unpacked matrix's prompt GEMM order (qgemm8.cpp)
//   Q6_K, per sub-block v: I = p_v (sc_2v sum (q - 32) x + sc_2v+1 sum (q - 32) x) over its two groups of 16 (int32:
//     at most 2 * 128 * 16 * 32 * 127 * 128 = 2,130,706,432), acc = fma(float(I), d_w * dk, acc); y = acc: the
//     unpacked matrix's prompt GEMM order (qgemm8.cpp), so a prompt's rows, which decode the packed units, agree
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qint8.h"
#include "qkblocks.h"

namespace wq {

namespace {

struct Field {  // a run of each row's unit: `bytes` from `offset`, packed `word` bytes at a time, 8 rows a word
  int offset, bytes, word;
};

// a unit: the bytes of one row per block (32 values) or super-block (256)
int unit_bytes(int qtype) {
  return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : qtype == Q5_K ? 176 : qtype == Q6_K ? 210 : 144;
}

int fields(int qtype, Field f[8]) {
  switch (qtype) {
    case Q4_0: f[0] = {0, 2, 2}, f[1] = {2, 16, 4}; return 2;
    case Q4_1: f[0] = {0, 2, 2}, f[1] = {2, 2, 2}, f[2] = {4, 16, 4}; return 3;
    case Q8_0: f[0] = {0, 2, 2}, f[1] = {2, 32, 4}; return 2;
    case Q4_K: f[0] = {0, 2, 2}, f[1] = {2, 2, 2}, f[2] = {4, 12, 4}, f[3] = {16, 128, 4}; return 4;
    case Q5_K: f[0] = {0, 2, 2}, f[1] = {2, 2, 2}, f[2] = {4, 12, 4}, f[3] = {16, 32, 4}, f[4] = {48, 128, 4}; return 5;
    case Q6_K:  // each half's ql[0..32), qh, ql[32..64): the order its sub-blocks first read them
      f[0] = {208, 2, 2}, f[1] = {192, 16, 1};
      for (int h = 0; h < 2; ++h) f[2 + 3 * h] = {64 * h, 32, 4}, f[3 + 3 * h] = {128 + 32 * h, 32, 4},
                                  f[4 + 3 * h] = {64 * h + 32, 32, 4};
      return 8;
    default: TORCH_CHECK(false, "ggml type ", qtype, " has no packed form (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K have)");
  }
}

// a word of 1, 2 or 4 bytes (a constant size each, so the copy is one move, not a call to memmove)
inline void copy_word(uint8_t* dst, const uint8_t* src, int word) {
  word == 4 ? std::memcpy(dst, src, 4) : word == 2 ? std::memcpy(dst, src, 2) : std::memcpy(dst, src, 1);
}

// one group's unit u: 8 rows of `ub` bytes at stride `stride` (rows) <-> 8 * ub packed bytes
void move_unit(const Field* f, int nf, uint8_t* rows, int64_t stride, uint8_t* packed, bool pack) {
  int64_t pos = 0;
  for (int i = 0; i < nf; ++i)
    for (int w = 0; w < f[i].bytes; w += f[i].word)
      for (int r = 0; r < 8; ++r, pos += f[i].word) {
        uint8_t* row = rows + r * stride + f[i].offset + w;
        pack ? copy_word(packed + pos, row, f[i].word) : copy_word(row, packed + pos, f[i].word);
      }
}

// the file's bytes of row r (0..7) of a packed group's unit u into out (ub bytes), by walking fields(): the scalar
// kernels' reference (packed_row_unit's constant-size copies give the K-quants' rows faster)
void row_unit(int qtype, const uint8_t* packed_unit, int r, uint8_t* out) {
  Field f[8];
  const int nf = fields(qtype, f);
  int64_t pos = 0;
  for (int i = 0; i < nf; ++i)
    for (int w = 0; w < f[i].bytes; w += f[i].word, pos += 8 * f[i].word)
      copy_word(out + f[i].offset + w, packed_unit + pos + r * f[i].word, f[i].word);
}

// ---------------------------------------------------------------- scalar: the order every path follows
template <int QT>  // Q4_0, Q4_1 (the unsigned nibble and the zero point's chain) and Q8_0 (the signed byte, no chain)
void blocks_scalar(const Job8& j, int64_t g0, int64_t g1) {
  constexpr int BB = QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : 34;
  const int64_t nb = j.k / 32, ldb = j.a->ldb;
  for (int64_t g = g0; g < g1; ++g)
    for (int n = 0; n < 8; ++n)
      for (int r = 0; r < j.m; ++r) {
        const int64_t xr = j.r0 + r;
        const int8_t* q = j.a->qb.data() + xr * j.k;
        const float* d8 = j.a->d8.data() + xr * j.k / 4;
        float acc = 0.f, macc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t blk[BB];
          row_unit(QT, j.w + g * 8 * j.row_bytes + b * 8 * BB, n, blk);
          const float dw = half_to_float(blk);
          const uint8_t* qs = blk + (QT == Q4_1 ? 4 : 2);
          float t = 0.f;  // the block's sum over its groups, then d_w once
          for (int gi = 0; gi < 4; ++gi) {
            int32_t isum = 0;
            for (int v = 8 * gi; v < 8 * gi + 8; ++v) {
              const int w = QT == Q8_0 ? static_cast<int8_t>(qs[v]) : v < 16 ? qs[v] & 15 : qs[v - 16] >> 4;
              isum += w * q[32 * b + v];
            }
            const float f = static_cast<float>(isum), dx = d8[8 * b + 2 * gi];
            t = gi == 0 ? f * dx : std::fma(f, dx, t);
          }
          acc = std::fma(t, dw, acc);
          if (QT != Q8_0) {
            const float mw = QT == Q4_1 ? half_to_float(blk + 2) : dw * -8.f;
            macc = std::fma(mw, j.a->s[xr * ldb + b], macc);
          }
        }
        j.y[r * j.ldy + 8 * g + n] = QT == Q8_0 ? acc : acc + macc;
      }
}

void q4k_scalar(const Job8& j, int64_t g0, int64_t g1) {
  const int64_t nsb = j.k / QK_K;
  const Act8& a = *j.a;
  for (int64_t g = g0; g < g1; ++g)
    for (int n = 0; n < 8; ++n)
      for (int r = 0; r < j.m; ++r) {
        const int64_t xr = j.r0 + r;
        float acc = 0.f, macc = 0.f;
        for (int64_t i = 0; i < nsb; ++i) {
          uint8_t blk[144];
          row_unit(Q4_K, j.w + g * 8 * j.row_bytes + i * 8 * 144, n, blk);
          int w[QK_K], sc[16], mn[8];
          super_ints<Q4_K>(blk, w, sc, mn);
          const int8_t* q = a.qs.data() + xr * j.k + i * QK_K;
          const int16_t* p = a.p.data() + (xr * nsb + i) * 8;
          const float dk = a.dk[xr * nsb + i];
          for (int h = 0; h < 2; ++h) {
            int32_t isum = 0;
            for (int v = 4 * h; v < 4 * h + 4; ++v) {
              int32_t s = 0;
              for (int t = 0; t < 32; ++t) s += w[32 * v + t] * q[32 * v + t];
              isum += sc[2 * v] * p[v] * s;
            }
            acc = std::fma(static_cast<float>(isum), half_to_float(blk) * dk, acc);
          }
          int32_t msum = 0;
          for (int v = 0; v < 8; ++v) msum += mn[v] * a.pq[(xr * nsb + i) * 8 + v];
          macc = std::fma(static_cast<float>(msum), half_to_float(blk + 2) * dk, macc);
        }
        j.y[r * j.ldy + 8 * g + n] = acc - macc;
      }
}

}  // namespace

// Each 16-value group's term of the x rows, for the packed Q6_K kernels, which take the weights unsigned (q, not
// q - 32) and the 32 sum x back: with vpdpbusd the group sum's start, -32 sum x; without it (pairs) the vpmaddubsw
// pairs' 32 (x_4t + x_4t+1) and 32 (x_4t+2 + x_4t+3) over the group's 4 words as an int16 pair, taken off the pairs'
// int16 sums (which may wrap and come back exact: |sum (q - 32) x| <= 4 * 2 * 32 * 127)
void q6k_group_terms(const Act8& a, int64_t row0, int64_t m, bool pairs, int32_t* out) {
  const int64_t ng = a.k / 16;
  for (int64_t r = 0; r < m; ++r) {
    const int8_t* x = a.qs.data() + (row0 + r) * a.k;
    for (int64_t gi = 0; gi < ng; ++gi) {
      int32_t lo = 0, hi = 0;
      const int8_t* g = x + 16 * gi;
      for (int t = 0; t < 16; t += 4) lo += g[t] + g[t + 1], hi += g[t + 2] + g[t + 3];
      out[r * ng + gi] = pairs ? static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(32 * lo)) |
                                                      (static_cast<uint32_t>(static_cast<uint16_t>(32 * hi)) << 16))
                               : -32 * (lo + hi);
    }
  }
}

namespace {

// Packed Q6_K's prefetches: 4 KB ahead (2-4 KB read fastest on Zen 4, 16 KB 0.9x at two and four rows), a sub-block's
// share of the unit at a time, each where it stands: GCC's scheduler gathers plain prefetches of the unrolled
// sub-blocks at the unit's top, where they queue more misses than a core keeps in flight (the 1.1B Q6_K's one-row
// forward 31.7-36.0 ms so, 27.7 pinned)
constexpr int64_t Q6_AHEAD = 4096;
inline void prefetch_pinned(const uint8_t* p) { __asm__ volatile("prefetcht0 %0" : : "m"(*p)); }

constexpr int64_t Q5_AHEAD = 4096;  // Q5_K's likewise, a quarter of the unit a chunk of two sub-blocks
constexpr int Q5_UNIT = 8 * 176, Q5_QH = 128, Q5_QS = 384;
constexpr int Q6_UNIT = 8 * 210, Q6_Q = 16 + 128;  // a packed super-block and its halves' first field (768 bytes each)

// ---------------------------------------------------------------- AVX2
#define P8_AVX2 __attribute__((target("avx2,fma,f16c")))

// the 4 bytes at p in every 32-bit lane
P8_AVX2 inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

#define P8_NAME blocks_avx2
#define P8_Q8NAME q8_avx2
#define P8_TARGET P8_AVX2
#define P8_DOT2(w0, x0, w1, x1) \
  _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast4(x0)), _mm256_maddubs_epi16(w1, bcast4(x1))), ones)
#define P8_Q8W(w) _mm256_abs_epi8(w)  // -128 -> 0x80: 128 unsigned; a pair at most 2 * 128 * 127 < 2^15
#define P8_Q8SUM(a0, w0, a1, w1, x0, x1, c)                                        \
  _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(bcast4(x0), w0)), ones), \
                   _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(bcast4(x1), w1)), ones))
#include "qpack8_blocks.inc"
#undef P8_NAME
#undef P8_Q8NAME
#undef P8_TARGET
#undef P8_DOT2
#undef P8_Q8W
#undef P8_Q8SUM

#define P6_NAME q6k_avx2
#define P6_TARGET P8_AVX2
#define P6_START(g) _mm256_setzero_si256()
#define P6_DOT(s, q, x) _mm256_add_epi16(s, _mm256_maddubs_epi16(q, bcast4(x)))
#define P6_END(s, g, sc)                                             \
  _mm256_madd_epi16(_mm256_sub_epi16(s, _mm256_set1_epi32(g)),       \
                    _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(sc, 16)))
#include "qpack8_q6k.inc"
#undef P6_NAME
#undef P6_TARGET
#undef P6_START
#undef P6_DOT
#undef P6_END
#define P6_START(g) _mm256_set1_epi32(g)
#define P6_END(s, g, sc) _mm256_mullo_epi32(s, sc)

#define P8_Q8W(w) _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)))  // w + 128, unsigned

#define P8_NAME blocks_avxvnni
#define P8_Q8NAME q8_avxvnni
#define P8_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define P8_DOT2(w0, x0, w1, x1) \
  _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w0, bcast4(x0)), w1, bcast4(x1))
#define P8_Q8SUM(a0, w0, a1, w1, x0, x1, c) _mm256_sub_epi32(P8_DOT2(a0, x0, a1, x1), _mm256_set1_epi32(c))
#include "qpack8_blocks.inc"
#define P6_NAME q6k_avxvnni
#define P6_TARGET P8_TARGET
#define P6_DOT(s, q, x) _mm256_dpbusd_avx_epi32(s, q, bcast4(x))
#include "qpack8_q6k.inc"
#undef P6_NAME
#undef P6_TARGET
#undef P6_DOT
#undef P8_NAME
#undef P8_Q8NAME
#undef P8_TARGET
#undef P8_DOT2
#undef P8_Q8SUM

#define P8_NAME blocks_avx512vnni
#define P8_Q8NAME q8_avx512vnni
#define P8_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
// the x words as vpdpbusd's embedded broadcast ({1to8}): the load port broadcasts them, where a vpbroadcastd of its
// own was an instruction of every dot product (GCC does not fold set1 into vpdpbusd); the same integer sums
typedef int32_t __attribute__((may_alias)) word_alias;
P8_TARGET inline __m256i dpbusd_word(__m256i acc, __m256i w, const int8_t* x) {
  __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const word_alias*>(x)));
  return acc;
}
#define P8_DOT2(w0, x0, w1, x1) dpbusd_word(dpbusd_word(_mm256_setzero_si256(), w0, x0), w1, x1)
#define P8_Q8SUM(a0, w0, a1, w1, x0, x1, c) _mm256_sub_epi32(P8_DOT2(a0, x0, a1, x1), _mm256_set1_epi32(c))
#include "qpack8_blocks.inc"
#define P6_NAME q6k_avx512vnni
#define P6_TARGET P8_TARGET
#define P6_DOT(s, q, x) dpbusd_word(s, q, x)
#include "qpack8_q6k.inc"
#undef P6_NAME
#undef P6_TARGET
#undef P6_DOT
#undef P6_START
#undef P6_END
#undef P8_NAME
#undef P8_Q8NAME
#undef P8_TARGET
#undef P8_DOT2
#undef P8_Q8SUM
#undef P8_Q8W

// ---------------------------------------------------------------- AVX-512 VNNI, two groups a vector
// Groups g and g + 1 side by side in a 512-bit vector, 16 weight rows a lane each: one vpdpbusd does the products
// two 256-bit ones did. Each lane's operations are those of the 256-bit forms above, in the same order (so are its
// bits). Where the core runs 512-bit integer multiply-adds on two ports (Intel's server cores since Skylake-SP, Zen 5)
// the arithmetic goes at twice the rate; where it splits them in two (Zen 4), as before.
Q512_TARGET inline __m512i dpbusd_word16(__m512i acc, __m512i w, const int8_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const word_alias*>(x)));
  return acc;
}
#define P8W_DOT2(w0, x0, w1, x1) dpbusd_word16(dpbusd_word16(_mm512_setzero_si512(), w0, x0), w1, x1)

// 32 bytes of group g at p and of group g + 1 at p + ldg: the low half and the high half
Q512_TARGET inline __m512i pair32(const uint8_t* p, int64_t ldg) { return pair256(p, p + ldg); }
// 8 float16 of group g at p and 8 of group g + 1 at p + ldg, as floats
Q512_TARGET inline __m512 pair_halves(const uint8_t* p, int64_t ldg) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + ldg)), 1));
}

template <int QT, int R>  // Q4_0, Q4_1: blocks_avx512vnni's steps on groups g and g + 1
Q512_TARGET void blocks_wide(const Job8& j, int r0, int64_t g) {
  constexpr int BB = QT == Q4_0 ? 18 : 20, UNIT = 8 * BB, QOFF = QT == Q4_0 ? 16 : 32;
  const int64_t nb = j.k / 32, ldb = j.a->ldb, ldg = 8 * j.row_bytes;
  const uint8_t* base = j.w + g * ldg;
  const __m512i m4 = _mm512_set1_epi8(15);
  const int8_t* xq[R];
  const float* xd[R];
  const float* xs[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = j.r0 + r0 + r;
    xq[r] = j.a->qb.data() + row * j.k, xd[r] = j.a->d8.data() + row * j.k / 4, xs[r] = j.a->s.data() + row * ldb;
  }
  __m512 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), macc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* u = base + b * UNIT;
    prefetch_span(u, UNIT);
    prefetch_span(u + ldg, UNIT);
    const __m512 dw = pair_halves(u, ldg);
    const __m512 mw = QT == Q4_1 ? pair_halves(u + 16, ldg) : _mm512_mul_ps(dw, _mm512_set1_ps(-8.f));
    __m512i w[8];  // word t: values 4t .. 4t + 3 of the 16 rows
    for (int c = 0; c < 4; ++c) {
      const __m512i v = pair32(u + QOFF + 32 * c, ldg);
      w[c] = _mm512_and_si512(v, m4), w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq[r] + 32 * b;
      const float* d = xd[r] + 8 * b;
      __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(P8W_DOT2(w[0], x, w[1], x + 4)), _mm512_set1_ps(d[0]));
      for (int gi = 1; gi < 4; ++gi) {
        const __m512i sum = P8W_DOT2(w[2 * gi], x + 8 * gi, w[2 * gi + 1], x + 8 * gi + 4);
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d[2 * gi]), t);
      }
      acc[r] = _mm512_fmadd_ps(t, dw, acc[r]);
      macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r][b]), macc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(j.y + (r0 + r) * j.ldy + 8 * g, _mm512_add_ps(acc[r], macc[r]));
}

template <int R>  // Q8_0: q8_avx512vnni's steps on groups g and g + 1
Q512_TARGET void q8_wide(const Job8& j, int r0, int64_t g) {
  constexpr int UNIT = 8 * 34;
  const int64_t nb = j.k / 32, ldg = 8 * j.row_bytes;
  const uint8_t* base = j.w + g * ldg;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* xq[R];
  const float* xd[R];
  const int32_t* xc[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = j.r0 + r0 + r;
    xq[r] = j.a->qb.data() + row * j.k, xd[r] = j.a->d8.data() + row * j.k / 4, xc[r] = j.a->c8.data() + row * j.k / 8;
  }
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* u = base + b * UNIT;
    prefetch_span(u, UNIT);
    prefetch_span(u + ldg, UNIT);
    const __m512 dw = pair_halves(u, ldg);
    __m512 t[R];
    for (int c = 0; c < 4; ++c) {  // the group of values 8c .. 8c + 7: words 2c and 2c + 1, w + 128 unsigned
      const __m512i a0 = _mm512_xor_si512(pair32(u + 16 + 64 * c, ldg), bias);
      const __m512i a1 = _mm512_xor_si512(pair32(u + 48 + 64 * c, ldg), bias);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq[r] + 32 * b + 8 * c;
        const __m512i sum = _mm512_sub_epi32(P8W_DOT2(a0, x, a1, x + 4), _mm512_set1_epi32(xc[r][4 * b + c]));
        const __m512 f = _mm512_cvtepi32_ps(sum), d = _mm512_set1_ps(xd[r][8 * b + 2 * c]);
        t[r] = c == 0 ? _mm512_mul_ps(f, d) : _mm512_fmadd_ps(f, d, t[r]);
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(t[r], dw, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(j.y + (r0 + r) * j.ldy + 8 * g, acc[r]);
}
#undef P8W_DOT2

// vpshufb patterns: byte e of each 32-bit lane zero-extended into both of its int16 halves (PAIRS[e]: a sub-block's
// scale as the vpmaddwd operand) or into the whole int32 (ONE[e]: a min); tables, so a loop over e loads them
struct Picks {
  alignas(32) int8_t pairs[4][32];
  alignas(32) int8_t one[4][32];
  Picks() {
    for (int e = 0; e < 4; ++e)
      for (int b = 0; b < 32; ++b) {
        const int lane = (b % 16) / 4, at = b % 4;
        pairs[e][b] = at % 2 == 0 ? static_cast<int8_t>(4 * lane + e) : -128;
        one[e][b] = at == 0 ? static_cast<int8_t>(4 * lane + e) : -128;
      }
  }
};
const Picks PICKS;

P8_AVX2 inline __m256i pick_pairs(int e) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(PICKS.pairs[e])); }
P8_AVX2 inline __m256i pick_one(int e) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(PICKS.one[e])); }

// a packed Q4_K unit's 12 scale bytes of 8 rows (3 words x 8 rows at u + 32) as vectors of 8 rows, scales_mins_k4
// lane by lane: sc[0] the scales of sub-blocks 0-3 (a byte each in every int32 lane), sc[1] of 4-7, mn likewise
P8_AVX2 inline void scales_mins8(const uint8_t* u, __m256i sc[2], __m256i mn[2]) {
  const __m256i k1 = _mm256_set1_epi32(0x3f3f3f3f), k2 = _mm256_set1_epi32(0x0f0f0f0f),
                k3 = _mm256_set1_epi32(0x03030303);
  const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32));
  const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64));
  const __m256i u2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 96));
  sc[0] = _mm256_and_si256(u0, k1);
  sc[1] = _mm256_or_si256(_mm256_and_si256(u2, k2),
                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), k3), 4));
  mn[0] = _mm256_and_si256(u1, k1);
  mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), k2),
                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), k3), 4));
}

#define P5_NAME q5k_avx2
#define P5_TARGET P8_AVX2
#define P5_WORDS 4
#define P5_DOT(s, w, x) _mm256_add_epi16(s, _mm256_maddubs_epi16(w, bcast4(x)))
#define P5_SCALE(sp) (sp)
#define P5_END(s, sp) _mm256_madd_epi16(s, sp)
#include "qpack8_q5k.inc"
#undef P5_NAME
#undef P5_TARGET
#undef P5_WORDS
#undef P5_DOT
#undef P5_SCALE
#undef P5_END
#define P5_WORDS 8
#define P5_SCALE(sp) _mm256_srli_epi32(sp, 16)
#define P5_END(s, sp) _mm256_mullo_epi32(s, sp)
#define P5_NAME q5k_avxvnni
#define P5_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define P5_DOT(s, w, x) _mm256_dpbusd_avx_epi32(s, w, bcast4(x))
#include "qpack8_q5k.inc"
#undef P5_NAME
#undef P5_TARGET
#undef P5_DOT
#define P5_NAME q5k_avx512vnni
#define P5_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define P5_DOT(s, w, x) dpbusd_word(s, w, x)
#include "qpack8_q5k.inc"
#undef P5_NAME
#undef P5_TARGET
#undef P5_DOT
#undef P5_WORDS
#undef P5_SCALE
#undef P5_END

#define PG_NAME gemm_avx512vnni
#define PG_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define PG_DPBUSD _mm256_dpbusd_epi32
#include "qpack8_gemm.inc"
#undef PG_NAME
#undef PG_TARGET
#undef PG_DPBUSD

#define PG_NAME gemm_avxvnni
#define PG_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define PG_DPBUSD _mm256_dpbusd_avx_epi32
#include "qpack8_gemm.inc"
#undef PG_NAME
#undef PG_TARGET
#undef PG_DPBUSD

// The packed Q4_K prompt tile on groups g and g + 1 in 512-bit vectors (AVX-512 VNNI with BW): R x rows by the pair's
// 16 weight rows, each lane's steps those of qpack8_gemm.inc's tiles (so its bits), the x words as {1to16} broadcasts
template <int R>
Q512_TARGET void q4k_gemm_wide(const Job8& j, int r0, const uint8_t* base, int64_t ldg, float* y, bool prefetch) {
  const int64_t nsb = j.k / QK_K;
  const Act8& a = *j.a;
  const __m512i m4 = _mm512_set1_epi8(15);
  const int64_t xr0 = j.r0 + r0;
  __m512 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), macc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* u = base + i * 1152;
    if (prefetch) prefetch_span(u, 1152), prefetch_span(u + ldg, 1152);
    const __m512 d = pair_halves(u, ldg), dmin = pair_halves(u + 16, ldg);
    __m256i sc0[2], mn0[2], sc1[2], mn1[2];
    scales_mins8(u, sc0, mn0);
    scales_mins8(u + ldg, sc1, mn1);
    __m512i sc[2], mn[2];
    for (int h = 0; h < 2; ++h) {
      sc[h] = _mm512_inserti64x4(_mm512_castsi256_si512(sc0[h]), sc1[h], 1);
      mn[h] = _mm512_inserti64x4(_mm512_castsi256_si512(mn0[h]), mn1[h], 1);
    }
    __m512i mv[8];  // each sub-block's min, 16 rows a vector (int32 lanes)
    for (int v = 0; v < 8; ++v) mv[v] = _mm512_shuffle_epi8(mn[v / 4], _mm512_broadcast_i64x4(pick_one(v % 4)));
    for (int r = 0; r < R; ++r) {
      const int32_t* pq = a.pq.data() + ((xr0 + r) * nsb + i) * 8;
      __m512i ms = _mm512_setzero_si512();
      for (int v = 0; v < 8; ++v) ms = _mm512_add_epi32(ms, _mm512_mullo_epi32(mv[v], _mm512_set1_epi32(pq[v])));
      const __m512 dk = _mm512_set1_ps(a.dk[(xr0 + r) * nsb + i]);
      macc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(dmin, dk), macc[r]);
    }
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      __m512i slo[R], shi[R];
      for (int r = 0; r < R; ++r) slo[r] = _mm512_setzero_si512(), shi[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m512i v = pair32(u + 128 + (8 * c + t) * 32, ldg);
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.qs.data() + (xr0 + r) * j.k + i * QK_K + 64 * c + 4 * t;
          slo[r] = dpbusd_word16(slo[r], lo, x);
          shi[r] = dpbusd_word16(shi[r], hi, x + 32);
        }
      }
      // times sc_j (a lane's) p_j (a row's): exact in int32
      const __m512i sl = _mm512_shuffle_epi8(sc[c / 2], _mm512_broadcast_i64x4(pick_one((2 * c) % 4)));
      const __m512i sh = _mm512_shuffle_epi8(sc[c / 2], _mm512_broadcast_i64x4(pick_one((2 * c + 1) % 4)));
      for (int r = 0; r < R; ++r) {
        const int16_t* p = a.p.data() + ((xr0 + r) * nsb + i) * 8;
        const __m512i pl = _mm512_mullo_epi32(sl, _mm512_set1_epi32(p[2 * c]));
        const __m512i ph = _mm512_mullo_epi32(sh, _mm512_set1_epi32(p[2 * c + 1]));
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(slo[r], pl),
                                                             _mm512_mullo_epi32(shi[r], ph)));
      }
      if (c % 2 == 1)  // a half done: into float
        for (int r = 0; r < R; ++r) {
          const __m512 dk = _mm512_set1_ps(a.dk[(xr0 + r) * nsb + i]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, dk), acc[r]);
          isum[r] = _mm512_setzero_si512();
        }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * j.ldy, _mm512_sub_ps(acc[r], macc[r]));
}

template <int R>
P8_AVX2 void q4k_avx2(const Job8& j, int r0, int64_t g) {
  const int64_t nsb = j.k / QK_K;
  const Act8& a = *j.a;
  const uint8_t* base = j.w + g * 8 * j.row_bytes;
  const __m256i m4 = _mm256_set1_epi8(15);
  const int64_t xr0 = j.r0 + r0;
  __m256 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), macc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* u = base + i * 1152;
    prefetch_span(u, 1152);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 16)));
    __m256i sc[2], mn[2];
    scales_mins8(u, sc, mn);
    const uint8_t* qs = u + 128;
    __m256i isum[R];
    for (int r = 0; r < R; ++r) {  // the mins first: msum = sum_v mn_v pq_v, 8 rows a vector
      const int32_t* pq = a.pq.data() + ((xr0 + r) * nsb + i) * 8;
      __m256i ms = _mm256_setzero_si256();
      for (int v = 0; v < 8; ++v)
        ms = _mm256_add_epi32(ms, _mm256_mullo_epi32(_mm256_shuffle_epi8(mn[v / 4], pick_one(v % 4)),
                                                     _mm256_set1_epi32(pq[v])));
      const __m256 dk = _mm256_set1_ps(a.dk[(xr0 + r) * nsb + i]);
      macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(dmin, dk), macc[r]);
      isum[r] = _mm256_setzero_si256();
    }
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      __m256i slo[R], shi[R];
      for (int r = 0; r < R; ++r) slo[r] = _mm256_setzero_si256(), shi[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {  // unrolled whole; the empty asm keeps each sum one chain (GCC spills a tree)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (8 * c + t) * 32));
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.qs.data() + (xr0 + r) * j.k + i * QK_K + 64 * c + 4 * t;
          slo[r] = _mm256_add_epi16(slo[r], _mm256_maddubs_epi16(lo, bcast4(x)));
          shi[r] = _mm256_add_epi16(shi[r], _mm256_maddubs_epi16(hi, bcast4(x + 32)));
          __asm__("" : "+x"(slo[r]), "+x"(shi[r]));
        }
      }
      const __m256i slo_s = _mm256_shuffle_epi8(sc[c / 2], pick_pairs((2 * c) % 4));
      const __m256i shi_s = _mm256_shuffle_epi8(sc[c / 2], pick_pairs((2 * c + 1) % 4));
      for (int r = 0; r < R; ++r) {
        const int16_t* p = a.p.data() + ((xr0 + r) * nsb + i) * 8;
        const __m256i sl = _mm256_mullo_epi16(slo_s, _mm256_set1_epi16(p[2 * c]));
        const __m256i sh = _mm256_mullo_epi16(shi_s, _mm256_set1_epi16(p[2 * c + 1]));
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(slo[r], sl),
                                                             _mm256_madd_epi16(shi[r], sh)));
      }
      if (c % 2 == 1)  // a half done: into float
        for (int r = 0; r < R; ++r) {
          const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(a.dk[(xr0 + r) * nsb + i]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), dd, acc[r]);
          isum[r] = _mm256_setzero_si256();
        }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(j.y + (r0 + r) * j.ldy + 8 * g, _mm256_sub_ps(acc[r], macc[r]));
}

using Group8 = void (*)(const Job8&, int, int64_t);
using Tile8 = void (*)(const Job8&, int, const uint8_t*, int64_t, float*, bool);

// a field of each row's unit back from a packed unit: B bytes from offset O, W bytes a word (constants, so every copy
// is one fixed-size move and the loops unroll), for rows [r0, r1) of its 8 (rows at `stride` apart from `rows`): the
// exact prompt GEMM gathers whole groups each call, the int8 prompt GEMM (its scalar path, AVX-VNNI's passes of 2
// rows, Q6_K without VNNI) one row's super-block at a time
template <int O, int B, int W>
inline void unpack_field(const uint8_t*& packed, uint8_t* rows, int64_t stride, int r0, int r1) {
  for (int w = 0; w < B; w += W, packed += 8 * W)
    for (int r = r0; r < r1; ++r) std::memcpy(rows + (r - r0) * stride + O + w, packed + r * W, W);
}

template <int QT>
constexpr int unit_of() {
  return QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : QT == Q8_0 ? 34 : QT == Q5_K ? 176 : QT == Q6_K ? 210 : 144;
}

// rows [r0, r1) of one packed unit back into ggml's layout, fields() in its order
template <int QT>
void unpack_unit(const uint8_t* packed, uint8_t* rows, int64_t stride, int r0, int r1) {
  if constexpr (QT == Q6_K) {
    unpack_field<208, 2, 2>(packed, rows, stride, r0, r1);
    unpack_field<192, 16, 1>(packed, rows, stride, r0, r1);
    unpack_field<0, 32, 4>(packed, rows, stride, r0, r1);
    unpack_field<128, 32, 4>(packed, rows, stride, r0, r1);
    unpack_field<32, 32, 4>(packed, rows, stride, r0, r1);
    unpack_field<64, 32, 4>(packed, rows, stride, r0, r1);
    unpack_field<160, 32, 4>(packed, rows, stride, r0, r1);
    unpack_field<96, 32, 4>(packed, rows, stride, r0, r1);
    return;
  }
  unpack_field<0, 2, 2>(packed, rows, stride, r0, r1);
  if constexpr (QT == Q4_0) unpack_field<2, 16, 4>(packed, rows, stride, r0, r1);
  if constexpr (QT == Q8_0) unpack_field<2, 32, 4>(packed, rows, stride, r0, r1);
  if constexpr (QT == Q4_1) {
    unpack_field<2, 2, 2>(packed, rows, stride, r0, r1);
    unpack_field<4, 16, 4>(packed, rows, stride, r0, r1);
  }
  if constexpr (QT == Q4_K || QT == Q5_K) {
    unpack_field<2, 2, 2>(packed, rows, stride, r0, r1);
    unpack_field<4, 12, 4>(packed, rows, stride, r0, r1);
  }
  if constexpr (QT == Q4_K) unpack_field<16, 128, 4>(packed, rows, stride, r0, r1);
  if constexpr (QT == Q5_K) {
    unpack_field<16, 32, 4>(packed, rows, stride, r0, r1);
    unpack_field<48, 128, 4>(packed, rows, stride, r0, r1);
  }
}

template <int QT>
void unpack_group(const uint8_t* group, int64_t row_bytes, uint8_t* out) {
  constexpr int ub = unit_of<QT>();
  for (int64_t u = 0; u < row_bytes / ub; ++u) unpack_unit<QT>(group + u * 8 * ub, out + u * ub, row_bytes, 0, 8);
}

}  // namespace

void packed_row_unit(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t u, uint8_t* out) {
  const uint8_t* unit = w + (n / 8) * 8 * row_bytes + u * 8 * unit_bytes(qtype);
  const int r = static_cast<int>(n % 8);
  switch (qtype) {
    case Q4_K: return unpack_unit<Q4_K>(unit, out, 0, r, r + 1);
    case Q5_K: return unpack_unit<Q5_K>(unit, out, 0, r, r + 1);
    case Q6_K: return unpack_unit<Q6_K>(unit, out, 0, r, r + 1);
    default: return row_unit(qtype, unit, r, out);
  }
}

void packed_row(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n, uint8_t* out) {
  const int ub = unit_bytes(qtype);
  for (int64_t u = 0; u < row_bytes / ub; ++u) packed_row_unit(qtype, w, row_bytes, n, u, out + u * ub);
}

void packed_group(int qtype, const uint8_t* w, int64_t row_bytes, int64_t g, uint8_t* out) {
  const uint8_t* group = w + g * 8 * row_bytes;
  switch (qtype) {
    case Q4_0: return unpack_group<Q4_0>(group, row_bytes, out);
    case Q4_1: return unpack_group<Q4_1>(group, row_bytes, out);
    case Q8_0: return unpack_group<Q8_0>(group, row_bytes, out);
    case Q4_K: return unpack_group<Q4_K>(group, row_bytes, out);
    case Q5_K: return unpack_group<Q5_K>(group, row_bytes, out);
    case Q6_K: return unpack_group<Q6_K>(group, row_bytes, out);
    default: TORCH_CHECK(false, "ggml type ", qtype, " has no packed form (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K have)");
  }
}

bool packs8(int qtype, int64_t n) {
  return (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 || is_kquant(qtype)) && n > 0 && n % 8 == 0;
}

void repack8(uint8_t* w, int64_t n, int64_t row_bytes, int qtype, bool pack) {
  TORCH_CHECK(packs8(qtype, n), "ggml type ", qtype, " with ", n, " rows has no packed form (Q4_0, Q4_1, Q8_0, ",
              "Q4_K, Q5_K and Q6_K with rows a multiple of 8 have)");
  Field f[8];
  const int nf = fields(qtype, f);
  const int ub = unit_bytes(qtype);
  TORCH_CHECK(row_bytes % ub == 0, "rows of ", row_bytes, " bytes are not whole units of ", ub);
  const int64_t units = row_bytes / ub;
  at::parallel_for(0, n / 8, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> tmp(8 * row_bytes);
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* group = w + g * 8 * row_bytes;
      std::memcpy(tmp.data(), group, tmp.size());
      for (int64_t u = 0; u < units; ++u)
        pack ? move_unit(f, nf, tmp.data() + u * ub, row_bytes, group + u * 8 * ub, true)
             : move_unit(f, nf, group + u * ub, row_bytes, tmp.data() + u * 8 * ub, false);
    }
  });
}

void packed8_rows(const Job8& j, int64_t n0, int64_t n1, int p) {
  TORCH_CHECK(n0 % 8 == 0 && n1 % 8 == 0, "packed rows go 8 at a time, got [", n0, ", ", n1, ")");
  const int64_t g0 = n0 / 8, g1 = n1 / 8;
  if (p < PATH_AVX2) {
    switch (j.qtype) {
      case Q4_0: return blocks_scalar<Q4_0>(j, g0, g1);
      case Q4_1: return blocks_scalar<Q4_1>(j, g0, g1);
      case Q8_0: return blocks_scalar<Q8_0>(j, g0, g1);
      case Q4_K: return q4k_scalar(j, g0, g1);
      case Q5_K:
      case Q6_K: {  // their order is the unpacked prompt GEMM's: its scalar loop reads packed rows, gathered back
        static const Panel8 none;  // the scalar path reads no panel
        return gemm8_rows(*j.a, none, j.r0, j.m, j.w, j.row_bytes, j.qtype, n0, n1, j.y, j.ldy, p, true);
      }
      default: TORCH_CHECK(false, "ggml type ", j.qtype, " has no packed kernel");
    }
  }
  if (j.qtype == Q5_K) {  // [vnni_kind()]: vpmaddubsw's int16 pairs, AVX-VNNI, AVX-512 VNNI (256-bit)
    static constexpr Group8 Q5K[3][4] = {{q5k_avx2<1>, q5k_avx2<2>, q5k_avx2<3>, q5k_avx2<4>},
                                         {q5k_avxvnni<1>, q5k_avxvnni<2>, q5k_avxvnni<3>, q5k_avxvnni<4>},
                                         {q5k_avx512vnni<1>, q5k_avx512vnni<2>, q5k_avx512vnni<3>, q5k_avx512vnni<4>}};
    for (int64_t g = g0; g < g1; ++g)
      for (int r0 = 0; r0 < j.m; r0 += 4) Q5K[vnni_kind()][(j.m - r0 < 4 ? j.m - r0 : 4) - 1](j, r0, g);
    return;
  }
  if (j.qtype == Q6_K) {  // [vnni_kind()]: vpmaddubsw's int16 pairs, AVX-VNNI, AVX-512 VNNI (256-bit)
    using Group6 = void (*)(const Job8&, int, int64_t, const int32_t*);
    static constexpr Group6 Q6K[3][4] = {{q6k_avx2<1>, q6k_avx2<2>, q6k_avx2<3>, q6k_avx2<4>},
                                         {q6k_avxvnni<1>, q6k_avxvnni<2>, q6k_avxvnni<3>, q6k_avxvnni<4>},
                                         {q6k_avx512vnni<1>, q6k_avx512vnni<2>, q6k_avx512vnni<3>, q6k_avx512vnni<4>}};
    const int vk = vnni_kind();
    const int32_t* terms = j.q6t;
    thread_local std::vector<int32_t> mine;  // a caller that made none: this call's
    if (terms == nullptr) {
      mine.resize(static_cast<size_t>(j.m) * j.k / 16);
      q6k_group_terms(*j.a, j.r0, j.m, vk == 0, mine.data());
      terms = mine.data();
    }
    for (int64_t g = g0; g < g1; ++g)
      for (int r0 = 0; r0 < j.m; r0 += 4) Q6K[vk][(j.m - r0 < 4 ? j.m - r0 : 4) - 1](j, r0, g, terms);
    return;
  }
  // Q4_K rows from 5 up (verify rows, several decoding sequences) take the prompt's tiles where VNNI is: the same bits
  // (1.15x at 5 rows, 1.37x at 16 over the 1.1B Q4_K_M's packed matrices); up to 4 rows wait on memory, not arithmetic
  if (j.qtype == Q4_K && j.m > 4 && vnni()) return packed8_gemm(j, n0, n1, p);
  // [vnni_kind()]: the AVX2 form, AVX-VNNI, AVX-512 VNNI (256-bit)
  static constexpr Group8 Q40[3][4] = {
      {blocks_avx2<Q4_0, 1>, blocks_avx2<Q4_0, 2>, blocks_avx2<Q4_0, 3>, blocks_avx2<Q4_0, 4>},
      {blocks_avxvnni<Q4_0, 1>, blocks_avxvnni<Q4_0, 2>, blocks_avxvnni<Q4_0, 3>, blocks_avxvnni<Q4_0, 4>},
      {blocks_avx512vnni<Q4_0, 1>, blocks_avx512vnni<Q4_0, 2>, blocks_avx512vnni<Q4_0, 3>, blocks_avx512vnni<Q4_0, 4>}};
  static constexpr Group8 Q41[3][4] = {
      {blocks_avx2<Q4_1, 1>, blocks_avx2<Q4_1, 2>, blocks_avx2<Q4_1, 3>, blocks_avx2<Q4_1, 4>},
      {blocks_avxvnni<Q4_1, 1>, blocks_avxvnni<Q4_1, 2>, blocks_avxvnni<Q4_1, 3>, blocks_avxvnni<Q4_1, 4>},
      {blocks_avx512vnni<Q4_1, 1>, blocks_avx512vnni<Q4_1, 2>, blocks_avx512vnni<Q4_1, 3>, blocks_avx512vnni<Q4_1, 4>}};
  static constexpr Group8 Q80[3][4] = {{q8_avx2<1>, q8_avx2<2>, q8_avx2<3>, q8_avx2<4>},
                                       {q8_avxvnni<1>, q8_avxvnni<2>, q8_avxvnni<3>, q8_avxvnni<4>},
                                       {q8_avx512vnni<1>, q8_avx512vnni<2>, q8_avx512vnni<3>, q8_avx512vnni<4>}};
  static constexpr Group8 Q4K[4] = {q4k_avx2<1>, q4k_avx2<2>, q4k_avx2<3>, q4k_avx2<4>};
  const int vk = vnni_kind();  // Q4_K's int16 sums over a scale's group keep vpmaddubsw on every CPU
  const Group8* fns = j.qtype == Q4_0 ? Q40[vk] : j.qtype == Q4_1 ? Q41[vk] : j.qtype == Q8_0 ? Q80[vk]
                      : j.qtype == Q4_K ? Q4K : nullptr;
  TORCH_CHECK(fns != nullptr, "ggml type ", j.qtype, " has no packed kernel");
  int64_t g = g0;
  // two groups a vector, the same bits: where the arithmetic is the bound. One or two x rows (a decode step of one
  // sequence, at int8 or int8x2) wait on memory, and there one group's stream a pass reads faster: on Zen 4 (one
  // process, the two alternating) the 1.1B files' one-row forward Q4_0 23.0 -> 20.8 ms, Q4_1 21.9 -> 16.7, Q8_0 32.3
  // -> 24.3, at two rows 1.06-1.07x, the default model's 5.1 -> 4.6; at four rows the pairs are faster (Q4_0: 34 ms
  // a group a pass, 31 in pairs)
  const bool few = j.m <= 2;
  if (j.qtype != Q4_K && vnni512(p) && !few) {
    static constexpr Group8 W40[4] = {blocks_wide<Q4_0, 1>, blocks_wide<Q4_0, 2>, blocks_wide<Q4_0, 3>,
                                      blocks_wide<Q4_0, 4>};
    static constexpr Group8 W41[4] = {blocks_wide<Q4_1, 1>, blocks_wide<Q4_1, 2>, blocks_wide<Q4_1, 3>,
                                      blocks_wide<Q4_1, 4>};
    static constexpr Group8 W80[4] = {q8_wide<1>, q8_wide<2>, q8_wide<3>, q8_wide<4>};
    const Group8* wide = j.qtype == Q4_0 ? W40 : j.qtype == Q4_1 ? W41 : W80;
    for (; g + 1 < g1; g += 2)  // a pair's 16 rows stay in L1 while every 4 x rows pass (more rows a pass spill)
      for (int r0 = 0; r0 < j.m; r0 += 4) wide[(j.m - r0 < 4 ? j.m - r0 : 4) - 1](j, r0, g);
  }
  for (; g < g1; ++g)  // a group's 8 rows stay in L1 while every 4 x rows pass
    for (int r0 = 0; r0 < j.m; r0 += 4) fns[(j.m - r0 < 4 ? j.m - r0 : 4) - 1](j, r0, g);
}

void packed8_gemm(const Job8& j, int64_t n0, int64_t n1, int p) {
  TORCH_CHECK(j.qtype == Q4_K, "the packed GEMM takes Q4_K, got ggml type ", j.qtype);
  TORCH_CHECK(n0 % 8 == 0 && n1 % 8 == 0, "packed rows go 8 at a time, got [", n0, ", ", n1, ")");
  TORCH_CHECK(vnni(), "the packed GEMM's tiles need VNNI (without it packed Q4_K prompts take gemm8_rows)");
  if (p < PATH_AVX2) return packed8_rows(j, n0, n1, p);  // q4k_scalar: the tiles' bits
  // [G - 1][R - 1]: AVX-512 VNNI's 32 registers hold 6 x rows by 2 groups (24 sums); AVX-VNNI's 16, 2 by 2
  static constexpr Tile8 WIDE[2][6] = {
      {gemm_avx512vnni<1, 1>, gemm_avx512vnni<2, 1>, gemm_avx512vnni<3, 1>, gemm_avx512vnni<4, 1>,
       gemm_avx512vnni<5, 1>, gemm_avx512vnni<6, 1>},
      {gemm_avx512vnni<1, 2>, gemm_avx512vnni<2, 2>, gemm_avx512vnni<3, 2>, gemm_avx512vnni<4, 2>,
       gemm_avx512vnni<5, 2>, gemm_avx512vnni<6, 2>}};
  static constexpr Tile8 NARROW[2][2] = {{gemm_avxvnni<1, 1>, gemm_avxvnni<2, 1>},
                                         {gemm_avxvnni<1, 2>, gemm_avxvnni<2, 2>}};
  const bool wide = vnni_kind() == 2;
  const int rmax = wide ? 6 : 2;
  const int64_t ldg = 8 * j.row_bytes;
  int64_t g = n0 / 8;
  if (vnni512(p)) {  // a pair of groups in 512-bit vectors, the same bits
    static constexpr Tile8 ZMM[4] = {q4k_gemm_wide<1>, q4k_gemm_wide<2>, q4k_gemm_wide<3>, q4k_gemm_wide<4>};
    for (; g + 1 < n1 / 8; g += 2)  // 4 x rows a pass (6 gave the same at 256 rows, less at 8)
      for (int r0 = 0; r0 < j.m; r0 += 4) {
        const int R = std::min(4, j.m - r0);
        ZMM[R - 1](j, r0, j.w + g * ldg, ldg, j.y + 8 * g, r0 == 0);
      }
  }
  for (; g < n1 / 8; g += 2) {  // a pair of groups stays in L1 while every rmax x rows pass
    const int G = n1 / 8 - g >= 2 ? 2 : 1;
    for (int r0 = 0; r0 < j.m; r0 += rmax) {
      const int R = std::min(rmax, j.m - r0);
      (wide ? WIDE[G - 1][R - 1] : NARROW[G - 1][R - 1])(j, r0, j.w + g * ldg, ldg, j.y + 8 * g, r0 == 0);
    }
  }
}

}  // namespace wq
