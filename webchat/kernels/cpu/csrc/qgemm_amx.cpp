// The exact prompt GEMM on AMX tiles (docs/quant.md, "The exact prompt GEMM"): y (m, n) = x (m, k) @ W^T, W the
// float32 values dequant_row gives, at float32 accuracy from bfloat16 tile products. A weight is its format's integer
// times a scale per 32 values plus an offset, s w + o, exactly; so
//   y[r, n] = sum_b s[n, b] (sum_{c in b} sum_{j + i <= 4} w_j[n, c] x_i[r, c]) + o[n, b] (sum_{c in b} x[r, c])
// where x = x1 + x2 + x3 exactly (each piece the next 8 significant bits as a bfloat16, by truncation: 24 bits make
// three) and w = w1 (+ w2 for Q6_K's scaled integers) exactly. Every product of two pieces is exact in float32 and
// TDPBF16PS sums a block's in float32; the pairs left out are each at most 2^-24 of |w x|, a float32 rounding's size.
// Each block's C tile is scaled into the row's float32 sums (3 TDPBF16PS a block of 32 values, 5 for Q6_K).
//
// Each output depends on its row of x and its row of W only (a tile element is its own sum; the zero padding of a short
// tile adds exact zeros), so a prompt's rows are the same bits however it is chunked or batched. Where the CPU has
// AMX-BF16 and the OS grants the tile data (Linux: arch_prctl ARCH_REQ_XCOMP_PERM), on the AVX-512 path; qgemm.cpp's
// float32 FMA tiles elsewhere (set_amx(0) or WEBCHAT_AMX=0 forces them).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qcommon.h"
#include "qint8.h"
#include "qkblocks.h"

namespace wq {

namespace {

#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-bf16")))

constexpr int TM = 16;  // weight rows a tile (A's rows); x rows a tile (B's and C's columns)
constexpr int XB = 32;  // values of x a block in the x tiles (B: 16 pairs of values by 16 x rows)

int g_amx = -1;  // -1: not chosen yet; 0: off; 1: on

// AMX-BF16 and AMX-TILE (CPUID leaf 7: EDX bits 22 and 24) and the OS's leave to use the tile data
bool cpu_amx() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl")) return false;
  unsigned a, b, c, d;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

struct TileConfig {  // LDTILECFG's 64 bytes (palette 1)
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

thread_local bool t_configured = false;

// tiles 0, 1: C (16 x 16 float32: two x tiles' sums); 2, 3, 4: the weight tile's pieces (16 rows x 32 bfloat16);
// 5, 6, 7: an x tile's pieces (16 pairs of values x 16 x rows x 2)
AMX_TARGET void configure() {
  if (t_configured) return;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = TM;
  // GCC 12 does not count LDTILECFG's read as a use of cfg: where this function was not inlined it dropped the stores
  // above and the tiles faulted; the clobber keeps them whatever the compiler inlines
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  t_configured = true;
}

AMX_TARGET void release() {  // the tile state back to its initial one (a context switch then saves nothing of it)
  _tile_release();
  t_configured = false;
}

// 32 floats (two vectors) as 3 pieces of bfloat16, each the high halves of float32s: v = p1 + p2 + p3 exactly
AMX_TARGET inline void pieces(__m512 v[2], __m512i p[3][2]) {
  const __m512i keep = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int j = 0; j < 3; ++j)
    for (int h = 0; h < 2; ++h) {
      p[j][h] = _mm512_and_si512(_mm512_castps_si512(v[h]), keep);
      v[h] = _mm512_sub_ps(v[h], _mm512_castsi512_ps(p[j][h]));
    }
}

// the high halves of 32 floats (a, b) as 32 bfloat16 in order
AMX_TARGET inline __m512i high_halves(__m512i a, __m512i b) {
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                       23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(a, odd, b);
}

// x's rows as B tiles: per tile of 16 x rows, block of 32 values and piece, 16 pairs of values by 16 rows (the pair
// (2kk, 2kk + 1) of row c at dword kk * 16 + c), and each row's sum of the block (the offsets' products); missing rows
// of the last tile are zeros
struct XTiles {
  int64_t tiles = 0, nb = 0;
  std::vector<uint16_t> b;  // (tiles, nb, 3, 16 pairs, 16 rows, 2)
  std::vector<float> sums;  // (tiles, nb, 16 rows)
  const uint16_t* at(int64_t t, int64_t blk, int p) const { return b.data() + ((t * nb + blk) * 3 + p) * 512; }
  const float* sum(int64_t t, int64_t blk) const { return sums.data() + (t * nb + blk) * TM; }
};

// r (16 vectors of 16 dwords) turned: r[i][j] <- r[j][i]
AMX_TARGET inline void turn16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4 g + e] holds, in its 128-bit lane q, column e + 4 q of rows 4 g .. 4 g + 3: turn those lanes 4 x 4
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// one tile's x rows (rows <= 16 of them; the rest zeros): per block each row's pieces as 16 pairs, turned so a row of
// the tile is a pair of values of every x row
AMX_TARGET void x_tile(const float* x, int64_t rows, int64_t k, int64_t nb, uint16_t* out, float* sums) {
  for (int64_t blk = 0; blk < nb; ++blk) {
    __m512i r[3][16];
    for (int64_t c = 0; c < TM; ++c) {
      if (c >= rows) {
        r[0][c] = r[1][c] = r[2][c] = _mm512_setzero_si512();
        sums[blk * TM + c] = 0.f;
        continue;
      }
      __m512 v[2] = {_mm512_loadu_ps(x + c * k + XB * blk), _mm512_loadu_ps(x + c * k + XB * blk + 16)};
      sums[blk * TM + c] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
      __m512i p[3][2];
      pieces(v, p);
      for (int j = 0; j < 3; ++j) r[j][c] = high_halves(p[j][0], p[j][1]);
    }
    for (int j = 0; j < 3; ++j) {
      turn16(r[j]);
      for (int kk = 0; kk < 16; ++kk) _mm512_storeu_si512(out + (blk * 3 + j) * 512 + kk * 32, r[j][kk]);
    }
  }
}

void build_x(const float* x, int64_t m, int64_t k, XTiles& xt) {
  xt.tiles = (m + TM - 1) / TM, xt.nb = k / XB;
  xt.b.resize(xt.tiles * xt.nb * 3 * 512);
  xt.sums.resize(xt.tiles * xt.nb * TM);
  at::parallel_for(0, xt.tiles, std::max<int64_t>(1, 512 / k), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      x_tile(x + t * TM * k, std::min<int64_t>(TM, m - t * TM), k, xt.nb, xt.b.data() + t * xt.nb * 3 * 512,
             xt.sums.data() + t * xt.nb * TM);
  });
}

// A weight block of 32 values as integers w and a scale and offset: value c is s w[c] + o exactly as dequant_row's
// float (ggml's formulas: Q4_0 d (q - 8), Q4_1 d q + m, Q5_0 d (q - 16), Q5_1 d q + m, Q8_0 d q, Q4_K/Q5_K d sc q -
// dmin m with the 6-bit sc and m of its 32 values; the products exact in float32). The integers fit 8 bits (one
// bfloat16 piece each, exact); Q6_K's (q - 32) times its 16-value groups' int8 scales take 13 bits (two pieces).
AMX_TARGET inline __m256i nibbles(__m128i b) {  // 16 bytes' low nibbles, then their high nibbles
  const __m128i m4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
}

// the block's 32 integers as one bfloat16 piece in order (exact: each at most 8 significant bits)
AMX_TARGET inline __m512i bf16_of_bytes(__m256i v) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
  return high_halves(_mm512_castps_si512(lo), _mm512_castps_si512(hi));
}

// one row's blocks of a 32-value format: out (nb, pieces, 16 rows, 32) at the row's place, s and o (nb, 2, 16)
AMX_TARGET void row_blocks32(int qtype, const uint8_t* row, int64_t nb, uint16_t* out, int64_t out_step, float* so,
                             int64_t so_step) {
  const int64_t bytes = block_bytes(qtype);
  const bool offset = qtype == Q4_1 || qtype == Q5_1, five = qtype == Q5_0 || qtype == Q5_1;
  const __m256i zero = _mm256_set1_epi8(static_cast<char>(offset ? 0 : five ? 16 : 8)), sixteen = _mm256_set1_epi8(16);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * bytes;
    __m256i v;
    if (qtype == Q8_0) {
      v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    } else {
      uint32_t qh = 0;
      if (five) std::memcpy(&qh, p + (offset ? 4 : 2), 4);
      v = nibbles(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (offset ? 4 : 2) + (five ? 4 : 0))));
      if (five) v = _mm256_mask_add_epi8(v, qh, v, sixteen);
      v = _mm256_sub_epi8(v, zero);
    }
    _mm512_storeu_si512(out + b * out_step, bf16_of_bytes(v));
    so[b * so_step] = half_to_float(p), so[b * so_step + TM] = offset ? half_to_float(p + 2) : 0.f;
  }
}

// one row's super-blocks of Q4_K or Q5_K: 8 blocks of 32 each
template <int QT>
AMX_TARGET void row_blocks_k45(const uint8_t* row, int64_t nb, uint16_t* out, int64_t out_step, float* so,
                               int64_t so_step) {
  const __m256i sixteen = _mm256_set1_epi8(16);
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* blk = row + sb * kbytes<QT>();
    uint8_t sc[8], mn[8];
    scales_mins_k4(blk + 4, sc, mn);
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    const uint8_t* q = blk + (QT == Q4_K ? 16 : 48);
    const __m256i qh = QT == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : __m256i{};
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
      __m256i v[2] = {_mm256_and_si256(bytes, m4), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4)};
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;
        if (QT == Q5_K)
          v[h] = _mm256_mask_add_epi8(v[h], _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << j))),
                                      v[h], sixteen);
        const int64_t b = 8 * sb + j;
        _mm512_storeu_si512(out + b * out_step, bf16_of_bytes(v[h]));
        so[b * so_step] = d * float(sc[j]), so[b * so_step + TM] = -dmin * float(mn[j]);
      }
    }
  }
}

// one row's super-blocks of Q6_K: (q - 32) sc as two pieces, s = d
AMX_TARGET void row_blocks_q6k(const uint8_t* row, int64_t nb, uint16_t* out, int64_t out_step, float* so,
                               int64_t so_step) {
  alignas(64) int w[QK_K];
  int sc[16], mn[8];
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* blk = row + sb * kbytes<Q6_K>();
    super_ints<Q6_K>(blk, w, sc, mn);
    const float d = half_to_float(blk + 208);
    for (int j = 0; j < 8; ++j) {
      const int64_t b = 8 * sb + j;
      __m512 f[2];
      for (int h = 0; h < 2; ++h)
        f[h] = _mm512_cvtepi32_ps(
            _mm512_mullo_epi32(_mm512_load_si512(w + 32 * j + 16 * h), _mm512_set1_epi32(sc[2 * j + h])));
      __m512i p[3][2];
      pieces(f, p);
      _mm512_storeu_si512(out + b * out_step, high_halves(p[0][0], p[0][1]));
      _mm512_storeu_si512(out + b * out_step + TM * XB, high_halves(p[1][0], p[1][1]));
      so[b * so_step] = d, so[b * so_step + TM] = 0.f;
    }
  }
}

// bfloat16 pieces of a weight integer (Q6_K's scaled ones take 13 bits: two) and whether the format has offsets
constexpr int weight_pieces(int qtype) { return qtype == Q6_K ? 2 : 1; }
constexpr bool has_offsets(int qtype) { return qtype == Q4_1 || qtype == Q5_1 || qtype == Q4_K || qtype == Q5_K; }

// A block of weight rows [n0, n0 + nn) as the A tiles: per tile of 16 rows and block of 32 values, the integers as
// bfloat16 pieces and each row's s and o; rows past nn (to whole groups of G tiles) are zeros
struct WBlock {
  std::vector<uint16_t> a;      // (tiles, nb, pieces, 16 rows, 32)
  std::vector<float> so;        // (tiles, nb, 2, 16): s then o of each row
  std::vector<uint8_t> gathered;
};

AMX_TARGET void decode_block(const MatRef& mr, int64_t k, int64_t n0, int64_t nn, int64_t tiles, WBlock& w) {
  const int64_t nb = k / XB;
  const int np = weight_pieces(mr.qtype);
  w.a.resize(tiles * nb * np * TM * XB);
  w.so.resize(tiles * nb * 2 * TM);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t rows = std::clamp<int64_t>(nn - tile * TM, 0, TM), first = n0 + tile * TM;
    const uint8_t* bytes = mr.w + first * mr.row_bytes;
    if (mr.packed && rows > 0) {  // packed 8 rows to a group for the int8 kernels: the tile's rows in ggml's layout
      w.gathered.resize(TM * mr.row_bytes);
      for (int64_t g = 0; g < rows / 8; ++g)
        packed_group(mr.qtype, mr.w, mr.row_bytes, first / 8 + g, w.gathered.data() + g * 8 * mr.row_bytes);
      bytes = w.gathered.data();
    }
    uint16_t* at = w.a.data() + tile * nb * np * TM * XB;
    float* so = w.so.data() + tile * nb * 2 * TM;
    const int64_t step = np * TM * XB;
    for (int i = 0; i < TM; ++i) {
      const uint8_t* row = bytes + i * mr.row_bytes;
      if (i >= rows) {
        for (int64_t b = 0; b < nb; ++b) {
          std::fill(at + b * step + i * XB, at + b * step + i * XB + XB, uint16_t(0));
          if (np == 2) std::fill(at + b * step + (TM + i) * XB, at + b * step + (TM + i) * XB + XB, uint16_t(0));
          so[b * 2 * TM + i] = so[b * 2 * TM + TM + i] = 0.f;
        }
      } else if (mr.qtype == Q4_K) {
        row_blocks_k45<Q4_K>(row, nb, at + i * XB, step, so + i, 2 * TM);
      } else if (mr.qtype == Q5_K) {
        row_blocks_k45<Q5_K>(row, nb, at + i * XB, step, so + i, 2 * TM);
      } else if (mr.qtype == Q6_K) {
        row_blocks_q6k(row, nb, at + i * XB, step, so + i, 2 * TM);
      } else {
        row_blocks32(mr.qtype, row, nb, at + i * XB, step, so + i, 2 * TM);
      }
    }
  }
}

// y rows [16 t, 16 t + 16) x columns [n0, n0 + nn) from a tile's sums (acc + 16 i, lane r: weight row i, x row r)
AMX_TARGET void write_tile(const float* acc, const MatRef& mr, int64_t m, int64_t t, int64_t n0, int64_t nn) {
  const int64_t rows = std::min<int64_t>(TM, m - t * TM);
  const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(static_cast<int>(mr.n)));
  float* y = mr.y + t * TM * mr.n + n0;
  for (int64_t i = 0; i < nn; ++i) _mm512_mask_i32scatter_ps(y + i, live, at, _mm512_loadu_ps(acc + TM * i), 4);
}

// G C tiles' block sums (stored at c, c[j][i][r]) scaled into their sums: acc[j][i] += s_i c[j][i] (+ o_i xs, xs the
// x rows' sums of the block)
template <int G, bool OFFSETS>
AMX_TARGET inline void scale_into(float* acc, const float* c, const float* so, int64_t so_tile, const float* xs) {
  const __m512 sums = OFFSETS ? _mm512_loadu_ps(xs) : _mm512_setzero_ps();
  for (int j = 0; j < G; ++j)
    for (int i = 0; i < TM; ++i) {
      float* a = acc + (j * TM + i) * TM;
      __m512 v = _mm512_fmadd_ps(_mm512_load_ps(c + (j * TM + i) * TM), _mm512_set1_ps(so[j * so_tile + i]),
                                 _mm512_load_ps(a));
      if (OFFSETS) v = _mm512_fmadd_ps(sums, _mm512_set1_ps(so[j * so_tile + TM + i]), v);
      _mm512_store_ps(a, v);
    }
}

// A block's products into C tile CT: the weight tile's pieces (4; Q6_K's second, 3) by the x pieces (5, 6, 7) whose
// ranks add to at most 4 (the three left out are each at most 2^-24 of |w x|); tile numbers literals (GCC's tile
// intrinsics spell them into the assembly)
#define WQ_PRODUCTS(CT, A)           \
  _tile_loadd(4, A, 64);             \
  _tile_zero(CT);                    \
  _tile_dpbf16ps(CT, 4, 5);          \
  _tile_dpbf16ps(CT, 4, 6);          \
  _tile_dpbf16ps(CT, 4, 7);          \
  if (TWO) {                         \
    _tile_loadd(3, A + TM * XB, 64); \
    _tile_dpbf16ps(CT, 3, 5);        \
    _tile_dpbf16ps(CT, 3, 6);        \
  }

// rows [n0, n0 + nn) of a matrix against every x tile, G weight tiles at a time: per block of k the x tile's pieces
// loaded once, each weight tile's products in its own C tile (G sums in flight), the C tiles stored and scaled into
// the sums in memory (acc: G tiles of 16 x 16, in L1) while the next block's products run
template <int G, bool TWO, bool OFFSETS>
AMX_TARGET void tile_rows(const MatRef& mr, int64_t m, int64_t k, int64_t n0, int64_t nn, int64_t tiles,
                          const XTiles& xt, const WBlock& w) {
  static_assert(G == 2 || G == 4, "two or four C tiles");
  const int64_t nb = k / XB, np = TWO ? 2 : 1, tile_step = nb * np * TM * XB, so_tile = nb * 2 * TM;
  alignas(64) float c[2][G * TM * TM];
  alignas(64) float acc[G * TM * TM];
  for (int64_t t = 0; t < xt.tiles; ++t)
    for (int64_t g = 0; g < tiles; g += G) {
      std::memset(acc, 0, sizeof(acc));
      const uint16_t* at = w.a.data() + g * tile_step;
      const float* so = w.so.data() + g * so_tile;
      for (int64_t blk = 0; blk < nb; ++blk) {
        const uint16_t* x = xt.at(t, blk, 0);
        _tile_loadd(5, x, 64);
        _tile_loadd(6, x + 512, 64);
        _tile_loadd(7, x + 1024, 64);
        const uint16_t* a = at + blk * np * TM * XB;
        float* cb = c[blk & 1];
        WQ_PRODUCTS(0, a);
        WQ_PRODUCTS(1, a + tile_step);
        if (G == 4) {
          WQ_PRODUCTS(2, a + 2 * tile_step);
          _tile_stored(0, cb, 64);
          WQ_PRODUCTS(3, a + 3 * tile_step);
          _tile_stored(1, cb + TM * TM, 64);
          _tile_stored(2, cb + 2 * TM * TM, 64);
          _tile_stored(3, cb + 3 * TM * TM, 64);
        } else {
          _tile_stored(0, cb, 64);
          _tile_stored(1, cb + TM * TM, 64);
        }
        if (blk > 0)
          scale_into<G, OFFSETS>(acc, c[(blk - 1) & 1], so + (blk - 1) * 2 * TM, so_tile, xt.sum(t, blk - 1));
      }
      scale_into<G, OFFSETS>(acc, c[(nb - 1) & 1], so + (nb - 1) * 2 * TM, so_tile, xt.sum(t, nb - 1));
      for (int j = 0; j < G && (g + j) * TM < nn; ++j)
        write_tile(acc + j * TM * TM, mr, m, t, n0 + (g + j) * TM, std::min<int64_t>(TM, nn - (g + j) * TM));
    }
}

#undef WQ_PRODUCTS

AMX_TARGET void block_rows(const MatRef& mr, int64_t m, int64_t k, int64_t n0, int64_t nn, const XTiles& xt,
                           WBlock& w) {
  const bool two = weight_pieces(mr.qtype) == 2;
  const int G = two ? 2 : 4;  // a second weight piece takes a tile: two C tiles then
  const int64_t tiles = ((nn + TM - 1) / TM + G - 1) / G * G;
  decode_block(mr, k, n0, nn, tiles, w);
  configure();
  if (two)
    tile_rows<2, true, false>(mr, m, k, n0, nn, tiles, xt, w);
  else if (has_offsets(mr.qtype))
    tile_rows<4, false, true>(mr, m, k, n0, nn, tiles, xt, w);
  else
    tile_rows<4, false, false>(mr, m, k, n0, nn, tiles, xt, w);
}

}  // namespace

bool amx() {
  if (g_amx < 0) g_amx = cpu_amx() ? 1 : 0;
  return g_amx > 0;
}

int set_amx(int on) {
  TORCH_CHECK(on >= -1 && on <= 1, "amx must be -1 (where the CPU and the OS allow it), 0 or 1, got ", on);
  const bool cpu = cpu_amx();
  TORCH_CHECK(on != 1 || cpu, "this CPU (or its OS) gives no AMX-BF16 tiles");
  g_amx = on < 0 ? cpu : on;
  return g_amx;
}

bool amx_covers(const MatRef* mats, int count, int64_t k) {
  if (!amx() || path() != PATH_AVX512 || k % XB != 0) return false;
  for (int i = 0; i < count; ++i)
    if (!(block_bytes(mats[i].qtype) > 0 || is_kquant(mats[i].qtype))) return false;
  return true;
}

void qgemm_amx_multi(const float* x, int64_t m, int64_t k, const MatRef* mats, int count) {
  thread_local XTiles xt;  // the calling thread's; the workers read it
  build_x(x, m, k, xt);
  const XTiles& tiles = xt;
  // blocks of weight rows whose tiles stay in L2 (at most ~512 KB, whole tiles, at most 8 tiles)
  int64_t per_tile = 0;  // bytes of a weight tile's blocks, the largest of the call's formats
  for (int i = 0; i < count; ++i)
    per_tile = std::max<int64_t>(per_tile, (k / XB) * (weight_pieces(mats[i].qtype) * TM * XB * 2 + 2 * TM * 4));
  int64_t fit = std::clamp<int64_t>((512 << 10) / per_tile, 1, 8);
  if (fit >= 4) fit = fit / 4 * 4;  // whole groups of block_rows' four C tiles
  const int64_t nc = TM * fit;
  std::vector<std::pair<int, int64_t>> jobs;  // (matrix, first row)
  for (int i = 0; i < count; ++i)
    for (int64_t n0 = 0; n0 < mats[i].n; n0 += nc) jobs.emplace_back(i, n0);
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t a, int64_t b) {
    thread_local WBlock w;
    for (int64_t j = a; j < b; ++j) {
      const MatRef& mr = mats[jobs[j].first];
      block_rows(mr, m, k, jobs[j].second, std::min(nc, mr.n - jobs[j].second), tiles, w);
    }
    release();
  });
}

}  // namespace wq
