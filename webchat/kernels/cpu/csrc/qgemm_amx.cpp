// The exact prompt GEMM on AMX tiles (docs/quant.md, "The exact prompt GEMM"):
//   y[r, n] = sum_u (d_nu * sum_{c in u} q_nc (x1 + x2 + x3)_rc + o_nu * sum_{c in u} x_rc)
// over the units u of a weight row (a block of 32 values; Q6_K: a group of 16), q its integers, d_nu its scale and o_nu
// its offset (Q4_1/Q5_1's m, the K-quants' -dmin m_j). x = x1 + x2 + x3 exactly: x1 is x's first 8 significant bits as
// a bfloat16 (truncated: x - x1 is exact in float32), x2 the next 8, x3 the last 8; every q is an integer of at most 8
// bits, exact in bfloat16, so every product x_p q is exact in float32 and TDPBF16PS sums them in float32: the products
// of the float32 model on the dequantized weights, summed in another order (within float32 rounding, as every exact
// path is). A weight tile (16 rows, a unit of values) meets the 3 pieces of 16 x rows' unit in 3 TDPBF16PS into one
// float32 tile C (16 x 16), which is stored and added into 16 float32 accumulators (a weight row each, an x row a lane)
// with the unit's d and o: the scale differs per unit, so a unit's sums leave the tile before the next one's. Two C
// tiles alternate, so the tile unit works on unit u + 1 while the vector units scale unit u.
//
// Each output depends on its row of x and its row of W only (a tile element is its own dot product; the zero padding
// of a short tile adds exact zeros), so a prompt's rows are the same bits however it is chunked or batched.
// Where the CPU has AMX-BF16 and the OS grants the tile data (Linux: arch_prctl ARCH_REQ_XCOMP_PERM), on the AVX-512
// path; qgemm.cpp's float32 FMA tiles elsewhere (set_amx(0) or WEBCHAT_AMX=0 forces them).
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

thread_local int t_unit = 0;  // the unit the calling thread's tiles are configured for (0: none)

// tiles 0, 1: C (16 x 16 float32); 2: A (16 weight rows x U bfloat16); 3, 4, 5: B (U / 2 pairs x 16 x rows)
AMX_TARGET void configure(int unit) {
  if (t_unit == unit) return;
  TileConfig cfg;
  cfg.colsb[0] = cfg.colsb[1] = 64, cfg.rows[0] = cfg.rows[1] = TM;
  cfg.colsb[2] = static_cast<uint16_t>(2 * unit), cfg.rows[2] = TM;
  for (int t = 3; t < 6; ++t) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<uint8_t>(unit / 2);
  _tile_loadconfig(&cfg);
  t_unit = unit;
}

// A weight row as integers q (int8) with each unit's scale d and offset o: element c of unit u is d_u q_c + o_u (up to
// float32 rounding: dequant_row's floats)
struct RowInts {
  int unit = XB;         // values a unit: 32, or 16 (Q6_K's groups)
  bool offsets = false;  // o is not all zero (Q4_1, Q5_1, Q4_K, Q5_K)
};

RowInts row_ints(int qtype) {
  RowInts r;
  r.unit = qtype == Q6_K ? 16 : XB;
  r.offsets = qtype == Q4_1 || qtype == Q5_1 || qtype == Q4_K || qtype == Q5_K;
  return r;
}

void decode_row(int qtype, const uint8_t* row, int64_t k, int8_t* q, float* d, float* o) {
  if (is_kquant(qtype)) {
    const int64_t bb = kq_block_bytes(qtype);
    int w[QK_K], sc[16], mn[8];
    for (int64_t s = 0; s < k / QK_K; ++s) {
      const uint8_t* blk = row + s * bb;
      int8_t* qs = q + s * QK_K;
      if (qtype == Q6_K) {
        super_ints<Q6_K>(blk, w, sc, mn);
        const float dd = half_to_float(blk + 208);
        for (int g = 0; g < 16; ++g) d[16 * s + g] = dd * static_cast<float>(sc[g]), o[16 * s + g] = 0.f;
      } else {
        qtype == Q4_K ? super_ints<Q4_K>(blk, w, sc, mn) : super_ints<Q5_K>(blk, w, sc, mn);
        const float dd = half_to_float(blk), dmin = half_to_float(blk + 2);
        for (int j = 0; j < 8; ++j)
          d[8 * s + j] = dd * static_cast<float>(sc[2 * j]), o[8 * s + j] = -(dmin * static_cast<float>(mn[j]));
      }
      for (int i = 0; i < QK_K; ++i) qs[i] = static_cast<int8_t>(w[i]);
    }
    return;
  }
  const int64_t bb = block_bytes(qtype);
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* blk = row + b * bb;
    int8_t* qb = q + 32 * b;
    d[b] = half_to_float(blk);
    o[b] = qtype == Q4_1 || qtype == Q5_1 ? half_to_float(blk + 2) : 0.f;
    if (qtype == Q8_0) {
      std::memcpy(qb, blk + 2, 32);
      continue;
    }
    const bool five = qtype == Q5_0 || qtype == Q5_1;
    const uint8_t* nib = blk + (qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 8);
    uint32_t qh = 0;
    if (five) std::memcpy(&qh, blk + (qtype == Q5_0 ? 2 : 4), 4);
    const int off = qtype == Q4_0 ? 8 : qtype == Q5_0 ? 16 : 0;
    for (int i = 0; i < 16; ++i) {
      qb[i] = static_cast<int8_t>(((nib[i] & 15) | (((qh >> i) & 1) << 4)) - off);
      qb[i + 16] = static_cast<int8_t>(((nib[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - off);
    }
  }
}

// 16 int8 as the bfloat16 of their value (exact: at most 8 significant bits), in place order
AMX_TARGET inline __m256i bf16_of_int8(const int8_t* q) {
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16));
}

// x's rows as the B tiles: per tile of 16 x rows, block b of 32 values and piece p, 16 pairs of values by 16 rows
// (pair kk of row c at dword kk * 16 + c), and each row's sum per block (the offsets' factor)
struct XTiles {
  int64_t tiles = 0, nb = 0;
  std::vector<uint16_t> b;  // (tiles, nb, 3, 16 pairs, 16 rows, 2)
  std::vector<float> sx;    // (tiles, nb, 16 rows)
  const uint16_t* at(int64_t t, int64_t blk, int p) const { return b.data() + ((t * nb + blk) * 3 + p) * 512; }
};

AMX_TARGET void x_row(const float* x, int64_t c, uint16_t* out, int64_t nb, float* sx) {
  const __m512i keep = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                       23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(TM));
  for (int64_t blk = 0; blk < nb; ++blk) {
    __m512 v[2] = {_mm512_loadu_ps(x + XB * blk), _mm512_loadu_ps(x + XB * blk + 16)};
    sx[blk * TM] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
    for (int p = 0; p < 3; ++p) {
      __m512i hi[2];
      for (int h = 0; h < 2; ++h) {  // the next 8 significant bits, and what is left
        hi[h] = _mm512_and_si512(_mm512_castps_si512(v[h]), keep);
        v[h] = _mm512_sub_ps(v[h], _mm512_castsi512_ps(hi[h]));
      }
      // the high halves of 32 floats in order: bfloat16 pairs (value 2kk, 2kk + 1) as dword kk
      const __m512i pairs = _mm512_permutex2var_epi16(hi[0], odd, hi[1]);
      _mm512_i32scatter_epi32(out + (blk * 3 + p) * 512 + 2 * c, rows, pairs, 4);
    }
  }
}

void build_x(const float* x, int64_t m, int64_t k, XTiles& xt) {
  xt.tiles = (m + TM - 1) / TM, xt.nb = k / XB;
  xt.b.resize(xt.tiles * xt.nb * 3 * 512);
  xt.sx.resize(xt.tiles * xt.nb * TM);
  const int64_t pad = xt.tiles * TM - m;
  if (pad > 0) {  // the last tile's missing rows: zero pieces and sums (exact zeros in every product)
    const int64_t t = xt.tiles - 1, c0 = TM - pad;
    for (int64_t blk = 0; blk < xt.nb; ++blk) {
      for (int p = 0; p < 3; ++p) {
        uint16_t* tile = xt.b.data() + ((t * xt.nb + blk) * 3 + p) * 512;
        for (int kk = 0; kk < 16; ++kk) std::fill(tile + kk * 32 + 2 * c0, tile + kk * 32 + 32, uint16_t(0));
      }
      std::fill(xt.sx.begin() + (t * xt.nb + blk) * TM + c0, xt.sx.begin() + (t * xt.nb + blk + 1) * TM, 0.f);
    }
  }
  at::parallel_for(0, m, std::max<int64_t>(1, 8192 / k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r / TM, c = r % TM;
      x_row(x + r * k, c, xt.b.data() + t * xt.nb * 3 * 512, xt.nb, xt.sx.data() + t * xt.nb * TM + c);
    }
  });
}

// One weight tile (rows [n0, n0 + nn) of a matrix) against every x tile: A (16 rows x unit, a unit at a time), its
// scales and offsets decoded once, then per x tile the units in turn through C0 / C1
struct WTile {
  std::vector<uint16_t> a;  // (units, 16 rows, unit) bfloat16
  std::vector<float> d, o;  // (units, 16 rows)
  std::vector<int8_t> q;    // (16 rows, k)
  std::vector<float> du, ou;  // (16 rows, units)
  std::vector<uint8_t> gathered;
};

AMX_TARGET void decode_tile(const MatRef& mr, int64_t k, int64_t n0, int64_t nn, const RowInts& ri, WTile& w) {
  const int64_t units = k / ri.unit;
  w.q.assign(TM * k, 0), w.du.assign(TM * units, 0.f), w.ou.assign(TM * units, 0.f);
  for (int64_t i = 0; i < nn; ++i) {
    const uint8_t* row = mr.w + (n0 + i) * mr.row_bytes;
    if (mr.packed) {  // packed 8 rows to a group for the int8 kernels: the row's bytes in ggml's order first
      w.gathered.resize(mr.row_bytes);
      packed_row(mr.qtype, mr.w, mr.row_bytes, n0 + i, w.gathered.data());
      row = w.gathered.data();
    }
    decode_row(mr.qtype, row, k, w.q.data() + i * k, w.du.data() + i * units, w.ou.data() + i * units);
  }
  w.a.resize(units * TM * ri.unit), w.d.resize(units * TM), w.o.resize(units * TM);
  for (int64_t u = 0; u < units; ++u)
    for (int i = 0; i < TM; ++i) {
      uint16_t* dst = w.a.data() + (u * TM + i) * ri.unit;
      for (int h = 0; h < ri.unit; h += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + h), bf16_of_int8(w.q.data() + i * k + u * ri.unit + h));
      w.d[u * TM + i] = w.du[i * units + u], w.o[u * TM + i] = w.ou[i * units + u];
    }
}

// unit u of the weight tile against x tile t: A and the 3 pieces of B loaded (tiles 2; 3, 4, 5); the C tile (its number
// a literal: GCC's tile intrinsics spell it into the assembly) then takes C = sum_p A_u B_{t,u,p}
AMX_TARGET inline void load_unit(const WTile& w, const XTiles& xt, int64_t t, int64_t u, int unit) {
  const int per = XB / unit;  // units a block of x (Q6_K: 2, its second the block's pairs 8 to 15)
  const uint8_t* b0 = reinterpret_cast<const uint8_t*>(xt.at(t, u / per, 0)) + (u % per) * (unit / 2) * 64;
  _tile_loadd(2, w.a.data() + u * TM * unit, 2 * unit);
  _tile_loadd(3, b0, 64);
  _tile_loadd(4, b0 + 1024, 64);
  _tile_loadd(5, b0 + 2048, 64);
}
#define WQ_ISSUE(CT)          \
  _tile_zero(CT);             \
  _tile_dpbf16ps(CT, 2, 3);   \
  _tile_dpbf16ps(CT, 2, 4);   \
  _tile_dpbf16ps(CT, 2, 5)

// acc[i] (weight row i, x rows as lanes) += d_ui C[i] + o_ui sx_u, C stored at c
AMX_TARGET inline void scale_unit(const WTile& w, const XTiles& xt, int64_t t, int64_t u, int unit, bool offsets,
                                  const float* c, __m512 acc[TM]) {
  const float* d = w.d.data() + u * TM;
  for (int i = 0; i < TM; ++i) acc[i] = _mm512_fmadd_ps(_mm512_load_ps(c + TM * i), _mm512_set1_ps(d[i]), acc[i]);
  if (offsets) {
    const __m512 sx = _mm512_loadu_ps(xt.sx.data() + (t * xt.nb + u * unit / XB) * TM);
    const float* o = w.o.data() + u * TM;
    for (int i = 0; i < TM; ++i) acc[i] = _mm512_fmadd_ps(sx, _mm512_set1_ps(o[i]), acc[i]);
  }
}

AMX_TARGET void tile_rows(const MatRef& mr, int64_t m, int64_t k, int64_t n0, const XTiles& xt, WTile& w) {
  const RowInts ri = row_ints(mr.qtype);
  const int64_t nn = std::min<int64_t>(TM, mr.n - n0), units = k / ri.unit;
  decode_tile(mr, k, n0, nn, ri, w);
  configure(ri.unit);
  for (int64_t t = 0; t < xt.tiles; ++t) {
    __m512 acc[TM];
    for (int i = 0; i < TM; ++i) acc[i] = _mm512_setzero_ps();
    alignas(64) float c[TM * TM];
    load_unit(w, xt, t, 0, ri.unit);
    WQ_ISSUE(0);
    for (int64_t u = 0; u < units; u += 2) {  // even units in C0, odd in C1: the next unit's products overlap the scaling
      if (u + 1 < units) {
        load_unit(w, xt, t, u + 1, ri.unit);
        WQ_ISSUE(1);
      }
      _tile_stored(0, c, 64);
      scale_unit(w, xt, t, u, ri.unit, ri.offsets, c, acc);
      if (u + 1 < units) {
        if (u + 2 < units) {
          load_unit(w, xt, t, u + 2, ri.unit);
          WQ_ISSUE(0);
        }
        _tile_stored(1, c, 64);
        scale_unit(w, xt, t, u + 1, ri.unit, ri.offsets, c, acc);
      }
    }
    alignas(64) float out[TM * TM];  // out[i][c]: weight row i, x row c
    for (int i = 0; i < TM; ++i) _mm512_store_ps(out + TM * i, acc[i]);
    const int64_t rows = std::min<int64_t>(TM, m - t * TM);
    for (int64_t c = 0; c < rows; ++c) {
      float* y = mr.y + (t * TM + c) * mr.n + n0;
      for (int64_t i = 0; i < nn; ++i) y[i] = out[TM * i + c];
    }
  }
}

#undef WQ_ISSUE

AMX_TARGET void release() {  // the tile state back to its initial one (a context switch then saves nothing of it)
  _tile_release();
  t_unit = 0;
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
  std::vector<std::pair<int, int64_t>> jobs;  // (matrix, first row)
  for (int i = 0; i < count; ++i)
    for (int64_t n0 = 0; n0 < mats[i].n; n0 += TM) jobs.emplace_back(i, n0);
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t a, int64_t b) {
    thread_local WTile w;
    for (int64_t j = a; j < b; ++j) tile_rows(mats[jobs[j].first], m, k, jobs[j].second, tiles, w);
    release();
  });
}

}  // namespace wq
