// int8 activations (docs/quant.md, "Two precisions"): each row of a matrix's input quantized to 8 bits once, the
// weights' integers multiplied with it in integer arithmetic (maddubs + madd on AVX2, vpdpbusd where VNNI exists),
// float32 only per block.
#pragma once

#include <cstdint>
#include <vector>

#include "qcommon.h"

namespace wq {

// m rows of k activations at 8 bits, in the forms the kernels read (each filled where a matrix of its family needs it).
//
// blocks (the 32-value formats): a scale for every 8 values, where llama.cpp's Q8_0/Q8_1 give 32 one (a float16):
//   per 8 values a = max |x|, d = a / 127, q = round(x * (127 / a)) (half to even); x ~ d q. Each block of 32 keeps
//   its four d twice over, in the order the kernels' int32 lanes hold the products (d0 d0 d1 d1 d2 d2 d3 d3: lane l
//   sums values 4l .. 4l + 3), and s = (d0 sum q0 + d1 sum q1) + (d2 sum q2 + d3 sum q3) for Q4_1/Q5_1's zero point.
//   c8 = 128 sum q per 8 values: what a weight made unsigned (w + 128, packed Q8_0 with VNNI) adds to the group's sum.
//   On the default model, a scale per 8 against one per 32 halves the largest logit error of the int8 path
//   (docs/quant.md), at no cost in the kernels: a block's scales are one vector either way.
// supers (the K-quants): per super-block of 256, A = max |x| and per sub-block j of 32 the largest e_j <= 7 with
//   a_j 2^e_j <= A; q = round((x 2^e_j) * (127 / A)), dk = A / 127 / 128, p_j = 2^(7 - e_j), pq_j = p_j * sum_j(q);
//   x ~ dk p_j q. llama.cpp's Q8_K gives all 256 values one scale; here a sub-block 2^e times smaller than the largest
//   keeps e more bits, and the power of two folds into the weights' integer sub-block scales (sc_j p_j fits int16).
// Rows of s are padded to whole groups of 8 blocks with zeros (the kernels read 8 at a time).
struct Act8 {
  int64_t m = 0, k = 0, ldb = 0, nsb = 0;  // ldb: s entries a row (k / 32 rounded up to 8); nsb = k / 256
  bool blocks = false, supers = false;
  std::vector<int8_t> qb, qs;   // (m, k): the blocks' q and the super-blocks' q
  std::vector<float> d8;        // (m, k / 32, 8): each block's four scales of 8 values, twice each
  std::vector<float> s;         // (m, ldb)
  std::vector<int32_t> c8;      // (m, k / 8)
  std::vector<float> dk;        // (m, nsb)
  std::vector<int16_t> p;       // (m, nsb, 8)
  std::vector<int32_t> pq;      // (m, nsb, 8)

  // room for rows x cols in the forms asked for (supers needs cols % 256 == 0)
  void shape(int64_t rows, int64_t cols, bool want_blocks, bool want_supers);
  void quantize(int64_t r, const float* x);  // row r from k floats, every form asked for, on the calling thread
  // rows r and r + 1 from k floats: row r as quantize makes it, row r + 1 what row r leaves of x (x - its value), so
  // x ~ row r + row r + 1 to about 15 bits (the int8x2 precision: a matrix multiplies both rows and adds the two)
  void quantize_pair(int64_t r, const float* x);
  void quantize_rows(const float* x, int64_t ldx);  // every row, rows split over the threads (each row as alone)

 private:
  void quantize_blocks(int64_t r, const float* x);
  void quantize_supers(int64_t r, const float* x);
};

// which forms a matrix of this type reads (F32 matrices read the float rows); false for types with no int8 kernel
inline bool reads_blocks(int qtype) { return block_bytes(qtype) > 0; }
inline bool reads_supers(int qtype) { return is_kquant(qtype); }
inline bool has_int8(int qtype) { return reads_blocks(qtype) || reads_supers(qtype); }

// Weight rows packed 8 to a group (qpack8.cpp): which matrices have the form, the packing in place both ways, and the
// int8 rows against them (n0, n1 multiples of 8)
bool packs8(int qtype, int64_t n);
void repack8(uint8_t* w, int64_t n, int64_t row_bytes, int qtype, bool pack);
// the file's bytes of row n's unit u (block or super-block) of a packed matrix into out
void packed_row_unit(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t u, uint8_t* out);
// the file's bytes of row n of a packed matrix into out (row_bytes): a tied head's row read as the embedding's
void packed_row(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n, uint8_t* out);
// the file's bytes of group g's 8 rows into out (8 rows of row_bytes): the exact GEMMs' tiles of a packed matrix
void packed_group(int qtype, const uint8_t* w, int64_t row_bytes, int64_t g, uint8_t* out);

// one call's share: y[r, n] for x rows [r0, r0 + m) of a, weight rows [n0, n1)
struct Job8 {
  const Act8* a;
  int r0, m;
  const uint8_t* w;
  int64_t row_bytes, k;
  int qtype;
  float* y;  // row r of this job at y + r * ldy
  int64_t ldy;
  const int32_t* q6t = nullptr;  // packed Q6_K on the vector paths: the job's x rows' group terms, k / 16 a row
};

void blocks8_rows(const Job8& j, int64_t n0, int64_t n1, int p);  // qint8.cpp
void supers8_rows(const Job8& j, int64_t n0, int64_t n1, int p);  // qint8k.cpp
void packed8_rows(const Job8& j, int64_t n0, int64_t n1, int p);  // qpack8.cpp
// the group terms packed Q6_K's vector kernels take for rows [row0, row0 + m) of a (k / 16 a row into out), made once a
// call before its threads split the weight rows (pairs: vpmaddubsw's int16 pairs, where vnni_kind() is 0)
void q6k_group_terms(const Act8& a, int64_t row0, int64_t m, bool pairs, int32_t* out);
// a prompt's rows against packed Q4_K where the CPU has VNNI: tiles of vpdpbusd (qpack8_gemm.inc) on the vector paths,
// q4k_scalar on the scalar one; the bits of packed8_rows either way (n0, n1 multiples of 8). Without VNNI such rows
// take gemm8_rows, which gathers each super-block back to ggml's order.
void packed8_gemm(const Job8& j, int64_t n0, int64_t n1, int p);
bool vnni();                                                       // vpdpbusd in use (qint8.cpp)
int vnni_kind();  // which vpdpbusd: 0 none (vpmaddubsw + vpmaddwd), 1 AVX-VNNI, 2 AVX-512 VNNI (256-bit forms)
bool vnni512(int p);  // on path p the int8 kernels take 512-bit forms (AVX-512 path, AVX-512 VNNI in use)
int set_vnni(int on);  // -1: where the CPU has it, 0: off, 1: on (the CPU must have it), 2: AVX-VNNI's forms
                       // (where a CPU has both, as its tests force them); returns whether vpdpbusd is in use

// The 512-bit int8 forms (qpack8.cpp, qgemm8.cpp: two 8-row groups side by side in a vector, where vnni512)
#define Q512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
// 32 bytes at lo as the low half, 32 at hi as the high
Q512_TARGET inline __m512i pair256(const void* lo, const void* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}

// Rows of Act8's super-blocks form 8 to a group, 4 bytes of each row side by side, for the prompt GEMM (qgemm8.cpp):
// per group and super-block, q (64 words x 8 rows x 4 bytes; on AVX-512 VNNI two groups side by side), p (8 sub-blocks
// x 8 rows x the power of two twice: an int16 pair per row), dk (8 rows); for the VNNI tiles, made only where VNNI is,
// pq (8 sub-blocks x 8 rows), sh (8 sub-blocks x 8 rows: log2 p) and c6 (16 groups of 16 values x 8 rows: -32 sum q,
// where Q6_K's sums start); a last group's missing rows are zeros
struct Panel8 {
  int64_t groups = 0, nsb = 0;
  std::vector<int8_t> q;  // where the 512-bit tiles run, groups 2u and 2u + 1 side by side (a word of 16 rows a load)
  int64_t ws = 32;         // bytes from one word of a group to its next: 32, or 64 side by side
  std::vector<int16_t> p;
  std::vector<int32_t> pq, sh, c6;
  std::vector<int16_t> x32;  // without VNNI: per group of 16 values, -32 (x_2i + x_2i+1) summed over its 4 words
  std::vector<int16_t> pm, sq;  // without VNNI: per pair of sub-blocks, each row's p_j and sum_j q side by side
  std::vector<float> dk;
  void build(const Act8& a, int64_t row0, int64_t m);  // rows [row0, row0 + m) of a
  // group g's super-block i in q: word w of its 8 rows (4 bytes each) at w * ws from there
  int64_t at(int64_t g, int64_t i) const {
    return ws == 32 ? (g * nsb + i) * 2048 : ((g / 2) * nsb + i) * 4096 + 32 * (g % 2);
  }
  const int8_t* words(int64_t g, int64_t i) const { return q.data() + at(g, i); }
};

// rows [row0, row0 + m) of a (the panel P built from them on the vector paths) against K-quant weight rows [n0, n1);
// packed: w is Q4_K packed 8 rows to a group (qpack8.cpp), each super-block gathered back as it is decoded
void gemm8_rows(const Act8& a, const Panel8& P, int64_t row0, int64_t m, const uint8_t* w, int64_t row_bytes,
                int qtype, int64_t n0, int64_t n1, float* y, int64_t ldy, int p, bool packed);

// Rows of Act8's blocks form 8 to a group for the Q8_0 GEMM (qgemm8b.cpp): per group and block, q (8 words x 8 rows x
// 4 bytes), c (4 groups of 8 values x 8 rows: 128 sum q) and d (4 x 8 rows: the group's scale)
struct PanelB {
  int64_t groups = 0, nb = 0;
  std::vector<int8_t> q;
  std::vector<int32_t> c;
  std::vector<float> d;
  void build(const Act8& a, int64_t row0, int64_t m);  // rows [row0, row0 + m) of a
};

// rows [row0, row0 + m) of a (the panel P built from them on the vector paths) against Q8_0 weight rows [n0, n1): a
// prompt's Q8_0 rows, vpdpbusd where the CPU has VNNI (vnni()), vpmaddubsw + vpmaddwd otherwise, the same bits
void q8_gemm_rows(const Act8& a, const PanelB& P, int64_t row0, int64_t m, const uint8_t* w, int64_t row_bytes,
                  int64_t n0, int64_t n1, float* y, int64_t ldy, int p);

// y_i (m, n_i) = rows [row0, row0 + m) of a @ W_i^T for matrices sharing their input: one parallel region over all
// their output rows. An F32 matrix takes x (those rows as floats, rows of a.k) through the float kernel. prompt: the
// rows are a prompt's, and the K-quants and Q8_0 take a GEMM (packed8_gemm, gemm8_rows, q8_gemm_rows) instead of the
// row kernels.
void qmatmul8_multi(const Act8& a, int64_t row0, int64_t m, const float* x, const MatRef* mats, int count,
                    bool prompt = false);

}  // namespace wq
