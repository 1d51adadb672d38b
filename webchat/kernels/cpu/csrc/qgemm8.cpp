// A prompt's rows against the K-quants with int8 activations, as a GEMM (docs/quant.md, "int8 activations"):
//
//   y[r, n] = sum_i [ sum_j fma-chain of I_j(r, n) * (d_n dk_r) ] - msum_i(r, n) * (dmin_n dk_r)
//   I_j = S_j sum_{t in sub-block j} w_t q_t (exact int32; Q6_K: sum over its two groups of 16, w = q - 32)
//
// The row kernels (qint8k.cpp) take one x row against one weight row, a vector of 32 values of one sub-block at a time,
// and pay a vpmaddwd and a scale shuffle for every vpmaddubsw. Here 8 rows of x lie side by side, 4 bytes each
// (Panel8): one 4-byte word of a weight row, broadcast, meets 8 x rows in one vpmaddubsw, and a sub-block's 8 words
// add up in int16 before one vpmaddwd by the scale (|pair| <= 2 * 15 * 127, 8 of them fit; Q5_K's 4; Q6_K's 4 words
// of its unsigned q, whose int16 sums may wrap and come back exact, |sum| <= 4 * 2 * 32 * 127, once the panel's
// 32 (x_2i + x_2i+1) over the group is taken off: llama.cpp's q6_K x q8_K form), so a lane holds one (x row, weight row)
// pair and no horizontal sum is left. The weights stay in
// ggml's layout: nothing is repacked, the same bytes serve the exact path, the row kernels and this.
//
// Each output is one chain over its own row of x and of W: the same bits however the prompt is chunked or grouped
// (tests/test_int8.py). Every path takes the float steps in the order of gemm_scalar (std::fma). Packed Q4_K rows
// (int8's layout of the file's Q4_K matrices, qpack8.cpp) take them in q4k_scalar's order instead: a half super-block's
// sub-blocks add up in int32 before one fma, and the mins run a chain of their own, subtracted at the end. That is the
// order of the packed row kernels and of the VNNI tiles (qpack8_gemm.inc), so a prompt's rows give the same bits on a
// CPU with VNNI or without, and the same as its decode rows. Packed Q5_K and Q6_K rows, decoded from their units 4 of
// a group at a time (AVX-VNNI's passes of 2 rows and Q6_K without VNNI gather them back), keep gemm_scalar's order,
// which their packed row kernels follow.
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

// ---------------------------------------------------------------- scalar: the order every path follows
// row n's super-block i in ggml's layout: where it lies, or (packed rows, qpack8.cpp) gathered into tmp
template <int QT>
inline const uint8_t* super_block(const uint8_t* wm, int64_t row_bytes, int64_t n, int64_t i, bool packed,
                                  uint8_t* tmp) {
  if (!packed) return wm + n * row_bytes + i * kbytes<QT>();
  packed_row_unit(QT, wm, row_bytes, n, i, tmp);
  return tmp;
}

template <int QT>
void gemm_scalar(const Act8& a, int64_t row0, int64_t m, const uint8_t* wm, int64_t row_bytes, int64_t n0,
                 int64_t n1, float* y, int64_t ldy, bool packed) {
  const int64_t nsb = a.k / QK_K;
  uint8_t tmp[kbytes<QT>()];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < m; ++r) {
      const int64_t xr = row0 + r;
      float acc = 0.f, macc = 0.f;
      for (int64_t i = 0; i < nsb; ++i) {
        const uint8_t* blk = super_block<QT>(wm, row_bytes, n, i, packed, tmp);
        const int8_t* q = a.qs.data() + xr * a.k + i * QK_K;
        const int16_t* p = a.p.data() + (xr * nsb + i) * 8;
        int w[QK_K], sc[16], mn[8];
        super_ints<QT>(blk, w, sc, mn);
        const float dk = a.dk[xr * nsb + i];
        const float dd = half_to_float(blk + (QT == Q6_K ? 208 : 0)) * dk;
        const bool halves = packed && QT == Q4_K;  // packed Q4_K: a half super-block's sums (q4k_scalar's order)
        int32_t half = 0;
        for (int j = 0; j < 8; ++j) {
          int32_t isum = 0;
          for (int t = 0; t < 32; ++t) isum += sc[2 * j + t / 16] * p[j] * w[32 * j + t] * q[32 * j + t];
          if (!halves) {
            acc = std::fma(static_cast<float>(isum), dd, acc);
            continue;
          }
          half += isum;
          if (j % 4 == 3) acc = std::fma(static_cast<float>(half), dd, acc), half = 0;
        }
        if (QT != Q6_K) {
          int32_t msum = 0;
          for (int j = 0; j < 8; ++j) msum += mn[j] * a.pq[(xr * nsb + i) * 8 + j];
          if (halves)
            macc = std::fma(static_cast<float>(msum), half_to_float(blk + 2) * dk, macc);
          else
            acc = std::fma(-static_cast<float>(msum), half_to_float(blk + 2) * dk, acc);
        }
      }
      y[r * ldy + n] = packed && QT == Q4_K ? acc - macc : acc;
    }
}

// ---------------------------------------------------------------- AVX2 on the panel
#define G8_AVX2 __attribute__((target("avx2,fma,f16c")))

// the 4 bytes at p in every 32-bit lane (vbroadcastss: a load, no shuffle)
G8_AVX2 inline __m256i bcast4(const int8_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

// one weight row's super-block as the GEMM reads it: its 256 integers a byte each (Q4_K, Q5_K), or Q6_K's unsigned q
// (0..63, not q - 32: the panel's pair sums take the 32 back), its scales and mins as ints, d and dmin
struct Decoded {
  alignas(32) int8_t w[QK_K];
  alignas(32) uint8_t u[QK_K];     // Q6_K's weights unsigned (q, not q - 32): vpmaddubsw's and vpdpbusd's operand
  int sci[16];                     // each group's scale as an int (the VNNI tiles' vpmulld operand)
  alignas(32) int16_t sc[16][16];  // each group's scale in all 16 lanes (the vpmullw operand)
  alignas(32) float d[8];          // d in all 8 lanes
  int mn[8];
  int32_t mnp[4];  // mins 2u and 2u + 1 as an int16 pair (the mins' vpmullw operand)
  float dmin;
};

// a Q4_K/Q5_K super-block's scales and mins (its first 16 bytes: d, dmin, 12 scale bytes)
G8_AVX2 inline void decode_meta(const uint8_t* blk, Decoded* o) {
  uint8_t s8[8], m8[8];
  scales_mins_k4(blk + 4, s8, m8);
  for (int v = 0; v < 8; ++v) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(o->sc[2 * v]), _mm256_set1_epi16(s8[v]));
    o->sci[2 * v] = o->sci[2 * v + 1] = s8[v];
    o->mn[v] = m8[v];
  }
  for (int u = 0; u < 4; ++u) o->mnp[u] = m8[2 * u] | (int32_t(m8[2 * u + 1]) << 16);
  _mm256_store_ps(o->d, _mm256_set1_ps(half_f16c(blk)));
  o->dmin = half_f16c(blk + 2);
}

template <int QT>
G8_AVX2 void decode(const uint8_t* blk, Decoded* o) {
  const __m256i m4 = _mm256_set1_epi8(15);
  if (QT == Q6_K) {
    for (int h = 0; h < 2; ++h) {
      __m256i q[4];
      q6_quarters(blk + 64 * h, blk + 128 + 32 * h, q);
      for (int c = 0; c < 4; ++c) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(o->u + 128 * h + 32 * c), q[c]);
      }
    }
    for (int g = 0; g < 16; ++g) {
      o->sci[g] = static_cast<int8_t>(blk[192 + g]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(o->sc[g]), _mm256_set1_epi16(static_cast<int16_t>(o->sci[g])));
    }
    _mm256_store_ps(o->d, _mm256_set1_ps(half_f16c(blk + 208)));
    o->dmin = 0.f;
    return;
  }
  const uint8_t* qs = blk + (QT == Q4_K ? 16 : 48);
  const __m256i qh = QT == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    if (QT == Q5_K) {
      const __m256i one = _mm256_set1_epi8(1);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(o->w + 64 * c), lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(o->w + 64 * c + 32), hi);
  }
  decode_meta(blk, o);
}

// packed Q4_K and Q5_K (qpack8.cpp): rows r0..r0 + 3 of a group's super-block i, decoded straight from its interleaved
// unit. Their values go to wp as the unit holds them, a word's 4 rows side by side (wp[j][t]: 4 bytes of each row), so
// no row is gathered back into ggml's layout first; scales, mins, d and dmin into dec as decode() gives them. Q5_K's
// unit has Q4_K's header, qh's words at 128 and the nibbles at 384; each value's fifth bit merges in as decode()'s.
template <int QT>
G8_AVX2 void decode_packed_k(const uint8_t* unit, int r0, int8_t (*wp)[8][16], Decoded* dec) {
  const __m128i m4 = _mm_set1_epi8(15), one = _mm_set1_epi8(1);
  const uint8_t* qs = unit + (QT == Q4_K ? 128 : 384);
  for (int c = 0; c < 4; ++c)
    for (int t = 0; t < 8; ++t) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (8 * c + t) * 32 + 4 * r0));
      __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
      if (QT == Q5_K) {  // qh's word t: bit 2c of each byte for the low nibbles, 2c + 1 for the high
        const __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 128 + t * 32 + 4 * r0));
        lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh, 2 * c), one), 4));
        hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh, 2 * c + 1), one), 4));
      }
      _mm_store_si128(reinterpret_cast<__m128i*>(wp[2 * c][t]), lo);
      _mm_store_si128(reinterpret_cast<__m128i*>(wp[2 * c + 1][t]), hi);
    }
  for (int n = 0; n < 4; ++n) {
    const int r = r0 + n;
    uint8_t hdr[16];  // the row's d, dmin and 12 scale bytes in ggml's order
    std::memcpy(hdr, unit + 2 * r, 2), std::memcpy(hdr + 2, unit + 16 + 2 * r, 2);
    for (int w = 0; w < 3; ++w) std::memcpy(hdr + 4 + 4 * w, unit + 32 + 32 * w + 4 * r, 4);
    decode_meta(hdr, &dec[n]);
  }
}

// packed Q6_K (qpack8.cpp): rows r0..r0 + 3 of a group's super-block i, decoded straight from its unit: word t of
// sub-block v (values 32v + 4t .. + 3, unsigned q) of the 4 rows side by side in wp[v][t], as decode_packed_k leaves
// Q4_K's nibbles; scales and d into dec as decode() gives them. The high bits merge as the packed row kernels do.
G8_AVX2 void decode_packed6(const uint8_t* unit, int r0, int8_t (*wp)[8][16], Decoded* dec) {
  const __m128i m4 = _mm_set1_epi8(15), m30 = _mm_set1_epi8(0x30);
  for (int v = 0; v < 8; ++v) {
    const int h = v / 4, c = v % 4;
    const uint8_t* qh = unit + 144 + 768 * h + 256;  // each half: ql[64h ..], qh[32h ..], ql[64h + 32 ..]
    const uint8_t* ql = c % 2 == 0 ? qh - 256 : qh + 256;
    for (int t = 0; t < 8; ++t) {
      const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 32 * t + 4 * r0));
      const __m128i hb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 32 * t + 4 * r0));
      const __m128i lo = c < 2 ? _mm_and_si128(l, m4) : _mm_and_si128(_mm_srli_epi16(l, 4), m4);
      const __m128i hi = c == 0 ? _mm_slli_epi16(hb, 4) : c == 1 ? _mm_slli_epi16(hb, 2)
                         : c == 2 ? hb : _mm_srli_epi16(hb, 2);
      _mm_store_si128(reinterpret_cast<__m128i*>(wp[v][t]), _mm_or_si128(lo, _mm_and_si128(hi, m30)));
    }
  }
  for (int n = 0; n < 4; ++n) {
    const int r = r0 + n;
    for (int g = 0; g < 16; ++g) {
      dec[n].sci[g] = static_cast<int8_t>(unit[16 + 8 * g + r]);
      const __m256i sc = _mm256_set1_epi16(static_cast<int16_t>(dec[n].sci[g]));
      _mm256_store_si256(reinterpret_cast<__m256i*>(dec[n].sc[g]), sc);
    }
    _mm256_store_ps(dec[n].d, _mm256_set1_ps(half_f16c(unit + 2 * r)));
    dec[n].dmin = 0.f;
  }
}

// rows n0 .. n0 + 3 of packed QT's super-block i (n0 % 8: 0 or 4), decoded from its unit: words into wp, the rest dec
template <int QT>
G8_AVX2 void decode_packed(const uint8_t* wm, int64_t row_bytes, int64_t n0, int64_t i, int8_t (*wp)[8][16],
                           Decoded* dec) {
  const uint8_t* unit = wm + (n0 / 8) * 8 * row_bytes + i * 8 * kbytes<QT>();
  if constexpr (QT == Q6_K) decode_packed6(unit, static_cast<int>(n0 % 8), wp, dec);
  else decode_packed_k<QT>(unit, static_cast<int>(n0 % 8), wp, dec);
}

// weight row n's word t of sub-block j (4 unsigned bytes): in its Decoded, or (PK) in decode_packed's wp
template <int QT, bool PK>
inline const int8_t* word_at(const Decoded* dec, const int8_t* wp, int n, int j, int t) {
  if (PK) return wp + (8 * j + t) * 16 + 4 * n;
  return (QT == Q6_K ? reinterpret_cast<const int8_t*>(dec[n].u) : dec[n].w) + 32 * j + 4 * t;
}

// Q4_K / Q5_K / Q6_K: NR weight rows from n0 against every group of the panel. Per super-block the NR rows are
// decoded once (Decoded) and each group's x words, loaded once, meet all NR rows; the groups' accumulators wait in
// acc (groups x NR vectors) between super-blocks.
// PK: packed Q4_K or Q5_K, 4 rows of one group (decode_packed: their words in wp, not in dec[n]; packed Q6_K here
// gathers its rows back, gemm_vector).
template <int QT, int NR, bool PK = false>
G8_AVX2 void gemm_rows(const Panel8& P, int64_t m, const uint8_t* wm, int64_t row_bytes, int64_t n0, float* y,
                       int64_t ldy, float* acc, bool packed) {
  static_assert(!PK || (QT != Q6_K && NR == 4), "packed Q4_K and Q5_K rows are read 4 of a group's 8 at a time");
  constexpr bool HALVES = PK && QT == Q4_K;  // packed Q4_K: q4k_scalar's order (half super-blocks, the mins apart)
  constexpr int64_t BB = kbytes<QT>();
  constexpr int STEPS = QT == Q4_K ? 8 : 4;  // words a sub-block's int16 sums take before they must widen
  const int64_t nsb = P.nsb, groups = P.groups;
  std::fill(acc, acc + groups * NR * 8 * (HALVES ? 2 : 1), 0.f);
  float* const macc = acc + groups * NR * 8;  // HALVES: the mins' chains (q4k_scalar's order: acc - macc at the end)
  Decoded dec[NR];
  alignas(32) int8_t wp[PK ? 8 : 1][8][16];
  for (int64_t i = 0; i < nsb; ++i) {
    if constexpr (PK) {
      decode_packed<QT>(wm, row_bytes, n0, i, wp, dec);
    } else {
      for (int n = 0; n < NR; ++n) {
        uint8_t tmp[BB];
        decode<QT>(super_block<QT>(wm, row_bytes, n0 + n, i, packed, tmp), &dec[n]);
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t pb = g * nsb + i;
      const int8_t* xq = P.words(g, i);
      const int16_t* xp = P.p.data() + pb * 128;
      const __m256 dk = _mm256_loadu_ps(P.dk.data() + pb * 8);
      __m256 a[NR], dd[NR];
      for (int n = 0; n < NR; ++n)
        a[n] = _mm256_loadu_ps(acc + (g * NR + n) * 8), dd[n] = _mm256_mul_ps(_mm256_load_ps(dec[n].d), dk);
      __m256i isum[NR];
      for (int j = 0; j < 8; ++j) {
        const __m256i pw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + j * 16));
        // HALVES: a half super-block's sums add up in int32 first (at most 2^31 - 1, as the tiles)
        if (!HALVES || j % 4 == 0)
          for (int n = 0; n < NR; ++n) isum[n] = _mm256_setzero_si256();
        for (int t0 = 0; t0 < 8; t0 += STEPS) {
          __m256i s16[NR];
          for (int n = 0; n < NR; ++n) s16[n] = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int t = t0; t < t0 + STEPS; ++t) {  // unrolled whole; the empty asm keeps each sum one chain, where
                                                     // GCC rebuilt them as a tree and spilled the products
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (8 * j + t) * P.ws));
            for (int n = 0; n < NR; ++n) {
              const int8_t* wt = word_at<QT, PK>(dec, &wp[0][0][0], n, j, t);
              s16[n] = _mm256_add_epi16(s16[n], _mm256_maddubs_epi16(bcast4(wt), xv));
              __asm__("" : "+x"(s16[n]));
            }
          }
          if (QT == Q6_K) {  // plus the pairs' -32 (x_2i + x_2i+1) over the group (x32): each pair (q - 32) x
            const __m256i x32 =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.x32.data() + (pb * 16 + 2 * j + t0 / 4) * 16));
            for (int n = 0; n < NR; ++n) s16[n] = _mm256_add_epi16(s16[n], x32);
          }
          for (int n = 0; n < NR; ++n) {  // times the half's scale and each row's power of two (int16 pairs)
            const int16_t* s = dec[n].sc[QT == Q6_K ? 2 * j + t0 / 4 : 2 * j];
            const __m256i sp = _mm256_mullo_epi16(pw, _mm256_load_si256(reinterpret_cast<const __m256i*>(s)));
            isum[n] = _mm256_add_epi32(isum[n], _mm256_madd_epi16(s16[n], sp));
          }
        }
        if (!HALVES || j % 4 == 3)
          for (int n = 0; n < NR; ++n) a[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[n]), dd[n], a[n]);
      }
      if (QT != Q6_K) {  // sum_j mn_j pq_j, pq_j = p_j sum_j q: (mn_j p_j) <= 63 * 128 and sum_j q fit int16, so two
        // sub-blocks a vpmullw + vpmaddwd (exact int32), where a vpmulld per sub-block took a quarter of the kernel
        const int16_t* pm = P.pm.data() + pb * 64;
        const int16_t* sq = P.sq.data() + pb * 64;
        for (int n = 0; n < NR; ++n) {
          __m256i ms = _mm256_setzero_si256();
          for (int u = 0; u < 4; ++u) {
            const __m256i mp = _mm256_mullo_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pm + 16 * u)),
                                                  _mm256_set1_epi32(dec[n].mnp[u]));
            ms = _mm256_add_epi32(
                ms, _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sq + 16 * u)), mp));
          }
          const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(dec[n].dmin), dk);
          if (HALVES) {
            float* mo = macc + (g * NR + n) * 8;
            _mm256_storeu_ps(mo, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), dm, _mm256_loadu_ps(mo)));
          } else {
            a[n] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), dm, a[n]);
          }
        }
      }
      for (int n = 0; n < NR; ++n) _mm256_storeu_ps(acc + (g * NR + n) * 8, a[n]);
    }
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int n = 0; n < NR; ++n) {
      const float* out = acc + (g * NR + n) * 8;
      const float* mo = macc + (g * NR + n) * 8;
      for (int r = 0; r < 8 && 8 * g + r < m; ++r) y[(8 * g + r) * ldy + n0 + n] = HALVES ? out[r] - mo[r] : out[r];
    }
}

// ---------------------------------------------------------------- VNNI: tiles of vpdpbusd (qgemm8_vnni.inc)
#define G8V_NAME tile_avx512vnni
#define G8V_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define G8V_DPBUSD _mm256_dpbusd_epi32
#include "qgemm8_vnni.inc"
#undef G8V_NAME
#undef G8V_TARGET
#undef G8V_DPBUSD

#define G8V_NAME tile_avxvnni
#define G8V_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define G8V_DPBUSD _mm256_dpbusd_avx_epi32
#include "qgemm8_vnni.inc"
#undef G8V_NAME
#undef G8V_TARGET
#undef G8V_DPBUSD

Q512_TARGET inline __m512 pair_ps(const float* lo, const float* hi) { return _mm512_castsi512_ps(pair256(lo, hi)); }

// The AVX-512 path's tile: groups g0 and g0 + 1 of the panel side by side in 512-bit vectors (16 x rows) by NR weight
// rows, each lane's steps those of qgemm8_vnni.inc's tiles (so its bits): one vpdpbusd where those take two

template <int QT, int NR, bool PK>
Q512_TARGET void tile_zmm(const Panel8& P, const Decoded* dec, const int8_t* wp, int64_t i, int64_t g0, float* acc) {
  const int64_t nsb = P.nsb, pb = g0 * nsb + i, pb1 = pb + nsb;  // the two groups' panel blocks
  const int8_t* xq = P.words(g0, i);  // g0 even: its pair's words side by side (ws 64), a load a word
  const __m512 dk = pair_ps(P.dk.data() + pb * 8, P.dk.data() + pb1 * 8);
  __m512 a[NR], dd[NR];
  for (int n = 0; n < NR; ++n) {
    a[n] = pair_ps(acc + (g0 * NR + n) * 8, acc + ((g0 + 1) * NR + n) * 8);
    const __m256 d = _mm256_load_ps(dec[n].d);
    dd[n] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_broadcast_i64x4(_mm256_castps_si256(d))), dk);
  }
  for (int j = 0; j < 8; ++j) {
    // two chains a row, side by side: Q6_K's two 16-value groups (each its own scale; each sum starts at the group's
    // -32 sum q, the panel's c6, so it ends at sum (q - 32) x), or a sub-block's even and odd words (added before the
    // scale); one chain a row had each vpdpbusd wait on the one before
    __m512i s[2][NR];
    for (int h = 0; h < 2; ++h) {
      const __m512i s0 = QT == Q6_K ? pair256(P.c6.data() + pb * 128 + (2 * j + h) * 8,
                                              P.c6.data() + pb1 * 128 + (2 * j + h) * 8)
                                    : _mm512_setzero_si512();
      for (int n = 0; n < NR; ++n) s[h][n] = s0;
    }
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int t = QT == Q6_K ? 4 * h + u : 2 * u + h;
        const int64_t off = (8 * j + t) * 64;
        const __m512i xv = _mm512_loadu_si512(xq + off);  // both groups' 8 x rows
        for (int n = 0; n < NR; ++n) {
          int32_t word;  // unsigned bytes
          std::memcpy(&word, word_at<QT, PK>(dec, wp, n, j, t), 4);
          s[h][n] = _mm512_dpbusd_epi32(s[h][n], _mm512_set1_epi32(word), xv);
        }
      }
    const __m512i sh = pair256(P.sh.data() + pb * 64 + j * 8, P.sh.data() + pb1 * 64 + j * 8);
    for (int n = 0; n < NR; ++n) {  // times p_j (a shift) and the scale: gemm_scalar's integer
      const __m512i sc0 = _mm512_set1_epi32(dec[n].sci[2 * j]);
      const __m512i isum =
          QT == Q6_K ? _mm512_add_epi32(_mm512_mullo_epi32(_mm512_sllv_epi32(s[0][n], sh), sc0),
                                        _mm512_mullo_epi32(_mm512_sllv_epi32(s[1][n], sh),
                                                           _mm512_set1_epi32(dec[n].sci[2 * j + 1])))
                     : _mm512_mullo_epi32(_mm512_sllv_epi32(_mm512_add_epi32(s[0][n], s[1][n]), sh), sc0);
      a[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dd[n], a[n]);
    }
  }
  if (QT != Q6_K) {
    const int32_t* pq = P.pq.data();
    for (int n = 0; n < NR; ++n) {
      __m512i ms = _mm512_setzero_si512();
      for (int v = 0; v < 8; ++v)
        ms = _mm512_add_epi32(ms, _mm512_mullo_epi32(_mm512_set1_epi32(dec[n].mn[v]),
                                                     pair256(pq + pb * 64 + 8 * v, pq + pb1 * 64 + 8 * v)));
      const __m512 dm = _mm512_mul_ps(_mm512_set1_ps(dec[n].dmin), dk);
      a[n] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), dm, a[n]);
    }
  }
  for (int n = 0; n < NR; ++n) {
    _mm256_storeu_ps(acc + (g0 * NR + n) * 8, _mm512_castps512_ps256(a[n]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + ((g0 + 1) * NR + n) * 8),
                        _mm512_extracti64x4_epi64(_mm512_castps_si512(a[n]), 1));
  }
}

// NR weight rows from n0 against every group of the panel, GX groups a tile (AVX-512 VNNI: 4 by 2, 8 sums and their
// 8 scaled sums and 8 float accumulators in 32 registers; AVX-VNNI: 2 by 2)
// PK: packed Q5_K or Q6_K, 4 rows of one group, decoded straight from its units
template <int QT, int NR, bool WIDE, bool PK = false>
void gemm_rows_vnni(const Panel8& P, int64_t m, const uint8_t* wm, int64_t row_bytes, int64_t n0, float* y,
                    int64_t ldy, float* acc, bool packed) {
  static_assert(!PK || (QT != Q4_K && NR == 4), "the tiles read packed Q5_K and Q6_K rows 4 of a group's 8 at a time");
  constexpr int GX = 2;
  const int64_t nsb = P.nsb, groups = P.groups;
  const bool zmm = WIDE && vnni512(path());  // pairs of groups in 512-bit tiles
  TORCH_CHECK(!zmm || P.ws == 64, "the 512-bit tiles read a panel built for them (two groups side by side)");
  std::fill(acc, acc + groups * NR * 8, 0.f);
  Decoded dec[NR];
  alignas(32) int8_t wp[PK ? 8 : 1][8][16];
  const int8_t* w = &wp[0][0][0];
  for (int64_t i = 0; i < nsb; ++i) {
    if constexpr (PK) {
      decode_packed<QT>(wm, row_bytes, n0, i, wp, dec);
    } else {
      for (int n = 0; n < NR; ++n) {
        uint8_t tmp[kbytes<QT>()];
        decode<QT>(super_block<QT>(wm, row_bytes, n0 + n, i, packed, tmp), &dec[n]);
      }
    }
    int64_t g = 0;
    if (zmm)
      for (; g + 2 <= groups; g += 2) tile_zmm<QT, NR, PK>(P, dec, w, i, g, acc);
    for (; g + GX <= groups; g += GX)
      WIDE ? tile_avx512vnni<QT, NR, GX, PK>(P, dec, w, i, g, acc) : tile_avxvnni<QT, NR, GX, PK>(P, dec, w, i, g, acc);
    for (; g < groups; ++g)
      WIDE ? tile_avx512vnni<QT, NR, 1, PK>(P, dec, w, i, g, acc) : tile_avxvnni<QT, NR, 1, PK>(P, dec, w, i, g, acc);
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int n = 0; n < NR; ++n) {
      const float* out = acc + (g * NR + n) * 8;
      for (int r = 0; r < 8 && 8 * g + r < m; ++r) y[(8 * g + r) * ldy + n0 + n] = out[r];
    }
}

using Rows = void (*)(const Panel8&, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t, float*, bool);

template <int QT>
void gemm_vector(const Panel8& P, int64_t m, const uint8_t* wm, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
                 int64_t ldy, bool packed) {
  // [vnni_kind()]: NR weight rows a pass and the passes of NR and of 1 row
  static constexpr int NRS[3] = {4, 2, 4};
  static constexpr Rows WIDE[3] = {gemm_rows<QT, 4>, gemm_rows_vnni<QT, 2, false>, gemm_rows_vnni<QT, 4, true>};
  static constexpr Rows ONE[3] = {gemm_rows<QT, 1>, gemm_rows_vnni<QT, 1, false>, gemm_rows_vnni<QT, 1, true>};
  const int vk = vnni_kind(), nr = NRS[vk];
  thread_local std::vector<float> acc;  // (groups, NR, 8); packed Q4_K: twice, its mins' chains after
  acc.resize(P.groups * nr * 8 * 2);
  int64_t n = n0;
  // whole groups (packed8_rows' edges): half a group a pass, decoded from its units, where such a pass exists (packed
  // Q4_K with VNNI takes packed8_gemm's tiles instead; AVX-VNNI's passes of 2 rows, and packed Q6_K without VNNI,
  // whose direct decode was no faster there, gather the rows back)
  Rows unit_pass = nullptr;
  if constexpr (QT != Q6_K)
    if (vk == 0) unit_pass = gemm_rows<QT, 4, true>;
  if constexpr (QT != Q4_K)
    if (vk == 2) unit_pass = gemm_rows_vnni<QT, 4, true, true>;
  if (packed && unit_pass != nullptr) {
    TORCH_CHECK(n0 % 8 == 0 && n1 % 8 == 0, "packed rows go 8 at a time, got [", n0, ", ", n1, ")");
    for (; n < n1; n += 4) unit_pass(P, m, wm, row_bytes, n, y, ldy, acc.data(), true);
    return;
  }
  for (; n + nr <= n1; n += nr) WIDE[vk](P, m, wm, row_bytes, n, y, ldy, acc.data(), packed);
  for (; n < n1; ++n) ONE[vk](P, m, wm, row_bytes, n, y, ldy, acc.data(), packed);
}

}  // namespace

void Panel8::build(const Act8& a, int64_t row0, int64_t m) {
  TORCH_CHECK(a.supers, "the prompt GEMM reads the super-blocks form, which was not made");
  TORCH_CHECK(row0 >= 0 && row0 + m <= a.m, "rows [", row0, ", ", row0 + m, ") are outside the ", a.m, " quantized");
  groups = (m + 7) / 8, nsb = a.nsb;
  ws = vnni512(path()) ? 64 : 32;  // where tile_zmm runs, two groups' words a 512-bit load
  q.assign((ws == 64 ? (groups + 1) / 2 * 2 : groups) * nsb * 2048, 0), p.assign(groups * nsb * 128, 0);
  dk.assign(groups * nsb * 8, 0.f);
  const bool tiles = vnni();  // the VNNI tiles' fields, made only where they run; x32, pm and sq only where they do not
  pq.assign(tiles ? groups * nsb * 64 : 0, 0), sh.assign(tiles ? groups * nsb * 64 : 0, 0);
  c6.assign(tiles ? groups * nsb * 128 : 0, 0);
  x32.assign(tiles ? 0 : groups * nsb * 256, 0);
  pm.assign(tiles ? 0 : groups * nsb * 64, 0), sq.assign(tiles ? 0 : groups * nsb * 64, 0);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t g = r / 8, l = r % 8, xr = row0 + r;
    for (int64_t i = 0; i < nsb; ++i) {
      const int64_t pb = g * nsb + i;
      const int8_t* src = a.qs.data() + xr * a.k + i * QK_K;
      for (int w = 0; w < 64; ++w) std::memcpy(q.data() + at(g, i) + w * ws + 4 * l, src + 4 * w, 4);
      for (int j = 0; j < 8; ++j) {
        const int pj = a.p[(xr * nsb + i) * 8 + j];
        const int32_t pqj = a.pq[(xr * nsb + i) * 8 + j];
        p[pb * 128 + j * 16 + 2 * l] = p[pb * 128 + j * 16 + 2 * l + 1] = static_cast<int16_t>(pj);
        if (!tiles) {  // the mins' int16 pairs: sub-blocks 2u and 2u + 1 of row l in lanes 2l and 2l + 1
          pm[pb * 64 + (j / 2) * 16 + 2 * l + j % 2] = static_cast<int16_t>(pj);
          sq[pb * 64 + (j / 2) * 16 + 2 * l + j % 2] = static_cast<int16_t>(pqj / pj);  // sum_j q, exactly
          continue;
        }
        pq[pb * 64 + j * 8 + l] = pqj;
        sh[pb * 64 + j * 8 + l] = __builtin_ctz(static_cast<unsigned>(pj));  // p_j is a power of two
        for (int h = 0; h < 2; ++h) {  // Q6_K's 16-value groups: -32 sum q, where the tiles' sums start
          int32_t sum = 0;
          for (int t = 0; t < 16; ++t) sum += src[32 * j + 16 * h + t];
          c6[pb * 128 + (2 * j + h) * 8 + l] = -32 * sum;
        }
      }
      dk[pb * 8 + l] = a.dk[xr * nsb + i];
      if (tiles) continue;
      for (int g16 = 0; g16 < 16; ++g16)  // Q6_K's groups of 16: the pairs' sums over its 4 words, times -32
        for (int h = 0; h < 2; ++h) {
          int32_t sum = 0;
          for (int t = 0; t < 4; ++t) sum += src[16 * g16 + 4 * t + 2 * h] + src[16 * g16 + 4 * t + 2 * h + 1];
          x32[(pb * 16 + g16) * 16 + 2 * l + h] = static_cast<int16_t>(-32 * sum);
        }
    }
  }
}

void gemm8_rows(const Act8& a, const Panel8& P, int64_t row0, int64_t m, const uint8_t* w, int64_t row_bytes,
                int qtype, int64_t n0, int64_t n1, float* y, int64_t ldy, int p, bool packed) {
  const bool vec = p >= PATH_AVX2;
  TORCH_CHECK(!packed || is_kquant(qtype), "the prompt GEMM reads packed rows of the K-quants only, got ggml type ",
              qtype);
  switch (qtype) {
    case Q4_K:
      return vec ? gemm_vector<Q4_K>(P, m, w, row_bytes, n0, n1, y, ldy, packed)
                 : gemm_scalar<Q4_K>(a, row0, m, w, row_bytes, n0, n1, y, ldy, packed);
    case Q5_K:
      return vec ? gemm_vector<Q5_K>(P, m, w, row_bytes, n0, n1, y, ldy, packed)
                 : gemm_scalar<Q5_K>(a, row0, m, w, row_bytes, n0, n1, y, ldy, packed);
    case Q6_K:
      return vec ? gemm_vector<Q6_K>(P, m, w, row_bytes, n0, n1, y, ldy, packed)
                 : gemm_scalar<Q6_K>(a, row0, m, w, row_bytes, n0, n1, y, ldy, packed);
    default: TORCH_CHECK(false, "the int8 prompt GEMM takes Q4_K, Q5_K and Q6_K, got ggml type ", qtype);
  }
}

}  // namespace wq
