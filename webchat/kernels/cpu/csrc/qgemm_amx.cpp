// The exact prompt GEMM on AMX tiles (docs/quant.md, "The exact prompt GEMM"): y (m, n) = x (m, k) @ W^T, W the
// float32 values dequant_row gives, at float32 accuracy from bfloat16 tile products:
//   y[r, n] = sum_c sum_{i + j <= 4} w_i[n, c] x_j[r, c]
// where w = w1 + w2 + w3 and x = x1 + x2 + x3 exactly (each piece the next 8 significant bits as a bfloat16, by
// truncation: what is left is exact in float32, and 24 bits make three pieces). Every product of two pieces is exact in
// float32 and TDPBF16PS sums them in float32; the three pairs left out (w2 x3, w3 x2, w3 x3) are each at most 2^-24 of
// |w x|, a float32 rounding's size. So a tile holds its outputs' float32 sums across the whole row: 6 TDPBF16PS per
// 32 values of k (a weight tile's 3 pieces by an x tile's 3), nothing leaves the tile until the row is done, and the
// format's scales, offsets and 16-value groups (Q6_K) are in the dequantized floats.
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
// (2kk, 2kk + 1) of row c at dword kk * 16 + c); missing rows of the last tile are zeros
struct XTiles {
  int64_t tiles = 0, nb = 0;
  std::vector<uint16_t> b;  // (tiles, nb, 3, 16 pairs, 16 rows, 2)
  const uint16_t* at(int64_t t, int64_t blk, int p) const { return b.data() + ((t * nb + blk) * 3 + p) * 512; }
};

AMX_TARGET void x_row(const float* x, int64_t c, int64_t nb, uint16_t* out) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(TM));
  for (int64_t blk = 0; blk < nb; ++blk) {
    __m512 v[2] = {_mm512_loadu_ps(x + XB * blk), _mm512_loadu_ps(x + XB * blk + 16)};
    __m512i p[3][2];
    pieces(v, p);
    for (int j = 0; j < 3; ++j)
      _mm512_i32scatter_epi32(out + (blk * 3 + j) * 512 + 2 * c, rows, high_halves(p[j][0], p[j][1]), 4);
  }
}

void build_x(const float* x, int64_t m, int64_t k, XTiles& xt) {
  xt.tiles = (m + TM - 1) / TM, xt.nb = k / XB;
  xt.b.resize(xt.tiles * xt.nb * 3 * 512);
  const int64_t c0 = m - (xt.tiles - 1) * TM;  // rows of the last tile
  if (c0 < TM)
    for (int64_t blk = 0; blk < xt.nb; ++blk)
      for (int p = 0; p < 3; ++p) {
        uint16_t* tile = xt.b.data() + (((xt.tiles - 1) * xt.nb + blk) * 3 + p) * 512;
        for (int kk = 0; kk < 16; ++kk) std::fill(tile + kk * 32 + 2 * c0, tile + kk * 32 + 32, uint16_t(0));
      }
  at::parallel_for(0, m, std::max<int64_t>(1, 8192 / k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      x_row(x + r * k, r % TM, xt.nb, xt.b.data() + (r / TM) * xt.nb * 3 * 512);
  });
}

// A weight block: rows [n0, n0 + nn) of a matrix dequantized (dequant_row: the exact path's floats) and cut into 3
// pieces a block of 32 values, a tile's piece 16 rows x 32 bfloat16 (the A tiles); rows past nn are zeros
struct WBlock {
  std::vector<float> f;         // (16 rows, k): one tile's rows at a time
  std::vector<uint16_t> a;      // (tiles, nb, 3, 16 rows, 32)
  std::vector<float> acc;       // (tiles, 2, 16, 16): the C tiles between k chunks
  std::vector<uint8_t> gathered;
  bool third = false;           // any third piece is not zero (Q4_0/Q5_0's d (q - off) never has one)
};

AMX_TARGET void decode_block(const MatRef& mr, int64_t k, int64_t n0, int64_t nn, WBlock& w) {
  const int64_t nb = k / XB, tiles = (nn + TM - 1) / TM;
  w.f.resize(TM * k);
  w.a.resize(tiles * nb * 3 * TM * XB);
  __m512i any3 = _mm512_setzero_si512();
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t rows = std::min<int64_t>(TM, nn - tile * TM), first = n0 + tile * TM;
    const uint8_t* bytes = mr.w + first * mr.row_bytes;
    if (mr.packed) {  // packed 8 rows to a group for the int8 kernels: the tile's rows in ggml's layout first
      w.gathered.resize(TM * mr.row_bytes);
      for (int64_t g = 0; g < rows / 8; ++g)
        packed_group(mr.qtype, mr.w, mr.row_bytes, first / 8 + g, w.gathered.data() + g * 8 * mr.row_bytes);
      bytes = w.gathered.data();
    }
    for (int64_t i = 0; i < rows; ++i) dequant_row(mr.qtype, bytes + i * mr.row_bytes, k, w.f.data() + i * k);
    std::fill(w.f.begin() + rows * k, w.f.end(), 0.f);
    uint16_t* at = w.a.data() + tile * nb * 3 * TM * XB;
    for (int64_t blk = 0; blk < nb; ++blk)
      for (int i = 0; i < TM; ++i) {
        const float* f = w.f.data() + i * k + XB * blk;
        __m512 v[2] = {_mm512_loadu_ps(f), _mm512_loadu_ps(f + 16)};
        __m512i p[3][2];
        pieces(v, p);
        any3 = _mm512_or_si512(any3, _mm512_or_si512(p[2][0], p[2][1]));
        for (int j = 0; j < 3; ++j)
          _mm512_storeu_si512(at + ((blk * 3 + j) * TM + i) * XB, high_halves(p[j][0], p[j][1]));
      }
  }
  w.third = _mm512_test_epi32_mask(any3, any3) != 0;
}

// C(CT) += the products of the loaded weight pieces (2, 3, 4) and x pieces (5, 6, 7) whose ranks add to at most 4
// (the tile number a literal: GCC's tile intrinsics spell it into the assembly)
#define WQ_PRODUCTS(CT, THIRD)  \
  _tile_dpbf16ps(CT, 2, 5);     \
  _tile_dpbf16ps(CT, 2, 6);     \
  _tile_dpbf16ps(CT, 3, 5);     \
  _tile_dpbf16ps(CT, 2, 7);     \
  _tile_dpbf16ps(CT, 3, 6);     \
  if (THIRD) _tile_dpbf16ps(CT, 4, 5)

AMX_TARGET inline void load_x(const XTiles& xt, int64_t t, int64_t blk) {
  _tile_loadd(5, xt.at(t, blk, 0), 64);
  _tile_loadd(6, xt.at(t, blk, 1), 64);
  _tile_loadd(7, xt.at(t, blk, 2), 64);
}

constexpr int64_t KC = 4;  // blocks of k a chunk: two x tiles' chunk (24 KB) stays in L1 while the weight tiles pass

// y rows [16 t, 16 t + 16) x columns [n0, n0 + nn) from a C tile stored at c (c[i][r]: weight row i, x row r)
void write_tile(const float* c, const MatRef& mr, int64_t m, int64_t t, int64_t n0, int64_t nn) {
  const int64_t rows = std::min<int64_t>(TM, m - t * TM);
  for (int64_t r = 0; r < rows; ++r) {
    float* y = mr.y + (t * TM + r) * mr.n + n0;
    for (int64_t i = 0; i < nn; ++i) y[i] = c[TM * i + r];
  }
}

// rows [n0, n0 + nn) of a matrix against every x tile: per pair of x tiles and chunk of KC blocks of k, each weight
// tile in turn (its C tiles carried between chunks in w.acc), so the x chunk is read from L1 by every weight tile and
// the weight tiles stream from L2 (the block's pieces: nn x k x 6 bytes)
AMX_TARGET void block_rows(const MatRef& mr, int64_t m, int64_t k, int64_t n0, int64_t nn, const XTiles& xt,
                           WBlock& w) {
  const int64_t nb = k / XB, tiles = (nn + TM - 1) / TM;
  decode_block(mr, k, n0, nn, w);
  w.acc.resize(tiles * 2 * TM * TM);
  configure();
  for (int64_t t = 0; t < xt.tiles; t += 2) {  // two x tiles share each weight tile's loads
    const bool two = t + 1 < xt.tiles;
    for (int64_t b0 = 0; b0 < nb; b0 += KC) {
      const int64_t b1 = std::min(nb, b0 + KC);
      for (int64_t tile = 0; tile < tiles; ++tile) {
        float* acc = w.acc.data() + tile * 2 * TM * TM;
        if (b0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
        } else {
          _tile_loadd(0, acc, 64);
          _tile_loadd(1, acc + TM * TM, 64);
        }
        const uint16_t* at = w.a.data() + tile * nb * 3 * TM * XB;
        for (int64_t blk = b0; blk < b1; ++blk) {
          const uint16_t* a = at + blk * 3 * TM * XB;
          _tile_loadd(2, a, 64);
          _tile_loadd(3, a + TM * XB, 64);
          _tile_loadd(4, a + 2 * TM * XB, 64);
          load_x(xt, t, blk);
          WQ_PRODUCTS(0, w.third);
          if (two) {
            load_x(xt, t + 1, blk);
            WQ_PRODUCTS(1, w.third);
          }
        }
        _tile_stored(0, acc, 64);
        _tile_stored(1, acc + TM * TM, 64);
      }
    }
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const float* acc = w.acc.data() + tile * 2 * TM * TM;
      const int64_t cols = std::min<int64_t>(TM, nn - tile * TM);
      write_tile(acc, mr, m, t, n0 + tile * TM, cols);
      if (two) write_tile(acc + TM * TM, mr, m, t + 1, n0 + tile * TM, cols);
    }
  }
}

#undef WQ_PRODUCTS

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
  // blocks of weight rows whose pieces stay in L2 (at most ~512 KB, whole tiles, at most 8 tiles)
  const int64_t nc = TM * std::clamp<int64_t>((512 << 10) / (TM * k * 6), 1, 8);
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
