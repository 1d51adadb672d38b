// The model's forward over a ragged batch on the paged KV cache, as one C++ call. The same maths as
// webchat.model.transformer.Transformer.layers_forward with webchat.model.ops.PagedTorchOps:
//   h = x + pn(wo(attn(rope(qn(wq y)), rope(kn(wk y)), wv y))) with y = rms_norm(x);  x' = h + fn(w2(act(w1 y) * w3 y))
//   with y = rms_norm(h);  logits = head(rms_norm(x_L)) for the logit rows only. qn/kn: per-head norms (Qwen3,
//   Gemma 3) or none; pn/fn: Gemma's post norms or none; act: silu, or Gemma's gelu_tanh; attn: softmax of the scaled
//   (Gemma 2: soft-capped) scores over the row's sliding window or its whole past; x_0 = embedding (Gemma: times
//   sqrt(dim)).
// Every row is computed on its own (its matmul accumulations, its norm, its attention over its own sequence), so a
// row's numbers do not depend on what else is in the batch. What goes away is the Python and dispatch overhead
// around ~15 small ops per layer; the numbers are float32 throughout.
#include "qstep.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <utility>
#include <vector>

#include "qattn.h"
#include "qcommon.h"

namespace wq {

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

// x[i] = exp(x[i] - shift); returns the sum
AVX2_FN static float exp_sum_avx2(float* x, int64_t n, float shift) {
  const __m256 vs = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vs));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float r = hsum256(acc);
  for (; i < n; ++i) r += (x[i] = std::exp(x[i] - shift));
  return r;
}

// g[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u
static void silu_mul_scalar(float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

AVX2_FN static void silu_mul_avx2(float* g, const float* u, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  silu_mul_scalar(g + i, u + i, n - i);
}

// g[i] = gelu_tanh(g[i]) * u[i] = 0.5 g (1 + tanh(b (g + k g^3))) * u, tanh(z) = 1 - 2 / (1 + e^2z) (PyTorch's
// gelu(approximate="tanh") constants; the tanh within ~1e-7 of std::tanh)
constexpr float GELU_B = 0.7978845608028654f, GELU_K = 0.044715f;
static void gelu_mul_scalar(float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    g[i] = 0.5f * g[i] * (1.f + std::tanh(GELU_B * (g[i] + GELU_K * g[i] * g[i] * g[i]))) * u[i];
}

AVX2_FN static void gelu_mul_avx2(float* g, const float* u, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(0.5f);
  const __m256 b = _mm256_set1_ps(GELU_B), k = _mm256_set1_ps(GELU_K);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 z = _mm256_mul_ps(b, _mm256_fmadd_ps(_mm256_mul_ps(k, x), _mm256_mul_ps(x, x), x));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, exp256(_mm256_add_ps(z, z)))));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t)),
                                          _mm256_loadu_ps(u + i)));
  }
  gelu_mul_scalar(g + i, u + i, n - i);
}

static float exp_sum_scalar(float* x, int64_t n, float shift) {
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += (x[i] = std::exp(x[i] - shift));
  return r;
}

// ---------------------------------------------------------------- the KV cache's formats (webchat.model.kv_format)
// A head's row of hd values: float32, float16 (round to nearest even), or q8_0 blocks as ggml's quantize_row_q8_0_ref
// makes them (d = max|x| / 127 as float16, q = roundf(x * (1 / d)) with the float32 d); read back exactly as
// kv_format.decode reads them (a float16's value; q * d in float32), whatever the code path.
inline uint16_t to_half(float x) { return c10::Half(x).x; }
inline float from_half(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// H x of each 32 values of x (n a multiple of 32), unnormalised, then times `scale`: the butterflies (a + b, a - b)
// of the pairs h = 1, 2, 4, 8, 16 apart in that order, as kv_format.hadamard makes them
static void hadamard32(float* x, int64_t n, float scale) {
  for (int64_t b = 0; b < n; b += 32) {
    float* t = x + b;
    for (int h = 1; h < 32; h *= 2)
      for (int g = 0; g < 32; g += 2 * h)
        for (int j = g; j < g + h; ++j) {
          const float a = t[j], c = t[j + h];
          t[j] = a + c, t[j + h] = a - c;
        }
    if (scale != 1.f)
      for (int j = 0; j < 32; ++j) t[j] *= scale;
  }
}

static void store_row(KVKind kind, const float* x, int64_t hd, uint8_t* dst) {
  if (kind == KV_F32) return static_cast<void>(std::memcpy(dst, x, hd * sizeof(float)));
  if (kind == KV_F16) {
    for (int64_t i = 0; i < hd; ++i) {
      const uint16_t h = to_half(x[i]);
      std::memcpy(dst + 2 * i, &h, 2);
    }
    return;
  }
  for (int64_t b = 0; b < hd / 32; ++b) {  // q8_0 of the block's Walsh-Hadamard transform (kv_format)
    float xb[32];
    std::memcpy(xb, x + 32 * b, sizeof(xb));
    hadamard32(xb, 32, 1.f);
    uint8_t* blk = dst + 34 * b;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const uint16_t dh = to_half(d);
    std::memcpy(blk, &dh, 2);
    for (int j = 0; j < 32; ++j) blk[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(xb[j] * id)));
  }
}

// n rows of a head's k or v (row i at src + i * stride bytes) as float32 rows hd apart at out
static void load_rows_scalar(KVKind kind, const uint8_t* src, int64_t stride, int64_t n, int64_t hd, float* out) {
  for (int64_t i = 0; i < n; ++i, src += stride, out += hd) {
    if (kind == KV_F16) {
      for (int64_t c = 0; c < hd; ++c) {
        uint16_t h;
        std::memcpy(&h, src + 2 * c, 2);
        out[c] = from_half(h);
      }
      continue;
    }
    for (int64_t b = 0; b < hd / 32; ++b) {
      uint16_t dh;
      std::memcpy(&dh, src + 34 * b, 2);
      const float d = from_half(dh);
      const int8_t* q = reinterpret_cast<const int8_t*>(src + 34 * b + 2);
      for (int j = 0; j < 32; ++j) out[32 * b + j] = static_cast<float>(q[j]) * d;
    }
  }
}

AVX2_FN static void load_rows_avx2(KVKind kind, const uint8_t* src, int64_t stride, int64_t n, int64_t hd,
                                   float* out) {
  for (int64_t i = 0; i < n; ++i, src += stride, out += hd) {
    if (kind == KV_F16) {
      for (int64_t c = 0; c < hd; c += 8)
        _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * c))));
      continue;
    }
    for (int64_t b = 0; b < hd / 32; ++b) {
      uint16_t dh;
      std::memcpy(&dh, src + 34 * b, 2);
      const __m256 d = _mm256_set1_ps(from_half(dh));
      const uint8_t* q = src + 34 * b + 2;
      for (int j = 0; j < 32; j += 8) {
        const __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j)));
        _mm256_storeu_ps(out + 32 * b + j, _mm256_mul_ps(_mm256_cvtepi32_ps(qi), d));
      }
    }
  }
}

// y = w * x / sqrt(mean(x*x) + eps)
static void rms_norm_row(const float* x, const float* w, float* y, int64_t d, float eps) {
  float ss = 0.f;
  for (int64_t c = 0; c < d; ++c) ss += x[c] * x[c];
  const float inv = 1.f / std::sqrt(ss / float(d) + eps);
  for (int64_t c = 0; c < d; ++c) y[c] = w[c] * (x[c] * inv);
}

// rotate_half RoPE on heads of hd: o1 = x1*c - x2*s, o2 = x2*c + x1*s, in place
static void rope_heads(float* x, int64_t heads, int64_t hd, const float* c, const float* s) {
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * hd;
    for (int64_t e = 0; e < half; ++e) {
      const float x1 = xh[e], x2 = xh[e + half];
      xh[e] = x1 * c[e] - x2 * s[e];
      xh[e + half] = x2 * c[e] + x1 * s[e];
    }
  }
}

// fn(r) for rows [0, m), over the threads when there is enough of it (m rows of `width` values); rows independent,
// so the result is the same either way
template <typename Fn>
static void each_row(int64_t m, int64_t width, Fn fn) {
  if (m * width < (int64_t(1) << 16)) {
    for (int64_t r = 0; r < m; ++r) fn(r);
    return;
  }
  at::parallel_for(0, m, std::max<int64_t>(1, 8192 / width), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) fn(r);
  });
}

// y_i (m, n_i) = x (m, k) @ W_i^T (+ bias_i) for matrices sharing x and k, in one parallel region per run of the
// plan's rows (the token rows, or the head's logit rows), each run at its precision, each row's numbers its own
// whatever the batch:
// - EXACT: float32 activations; a prompt's rows take the GEMM (qgemm.cpp), other rows the row kernels, and any row
//   against a matrix packed for the int8 kernels the GEMM, which reads the packed rows (the row kernels read ggml's)
// - INT8: the int8 kernels (qint8.h) on act_, the rows of x at 8 bits made just before (quantize_for, or the norm or
//   SiLU that made x): a prompt's rows against the K-quants and Q8_0 as a GEMM, every other row the row kernels
// - INT8X2: the same kernels on both of each row's 8-bit rows (act_'s pair), then y = y_hi + y_lo; a float32 matrix
//   (qtype F32) takes x's rows through its float kernel as at INT8
void StepModel::linears(Mats mys, const float* x, const Plan& plan) {
  const int64_t k = mys.begin()->first->k;
  for (const Rows& run : plan.runs) {
    const int64_t m = run.hi - run.lo;
    if (run.prec == EXACT) {
      exact_rows(mys, x, run, k);
      continue;
    }
    MatRef refs[4], floats[4];
    int count = 0, nf = 0;
    int64_t offset = 0;  // INT8X2: matrix c's 2m rows of products at pair_ + its offset
    if (run.prec == INT8X2) {
      int64_t need = 0;
      for (const auto& my : mys) need += my.first->qtype == F32 ? 0 : 2 * m * my.first->n;
      if (static_cast<int64_t>(pair_.size()) < need) pair_.resize(need);
    }
    for (const auto& my : mys) {
      const Mat& w = *my.first;
      float* y = my.second + run.lo * w.n;
      if (run.prec == INT8X2 && w.qtype == F32) {
        floats[nf++] = MatRef{w.w, w.n, w.row_bytes, w.qtype, y, false};
      } else if (run.prec == INT8X2) {
        refs[count++] = MatRef{w.w, w.n, w.row_bytes, w.qtype, pair_.data() + offset, w.packed};
        offset += 2 * m * w.n;
      } else {
        refs[count++] = MatRef{w.w, w.n, w.row_bytes, w.qtype, y, w.packed};
      }
    }
    const int64_t a_rows = run.prec == INT8X2 ? 2 * m : m;
    if (count > 0) qmatmul8_multi(act_, run.a8, a_rows, x + run.lo * k, refs, count, run.prompt);
    if (nf > 0) qmatmul8_multi(act_, run.a8, m, x + run.lo * k, floats, nf, run.prompt);
    if (run.prec != INT8X2) continue;
    int c = 0;
    for (const auto& my : mys) {  // y = (x_hi + x_lo) W^T = x_hi W^T + x_lo W^T, a row's two products added
      if (my.first->qtype == F32) continue;
      const int64_t n = my.first->n;
      const float* two = refs[c++].y;
      float* y = my.second + run.lo * n;
      each_row(m, n, [&](int64_t r) {
        for (int64_t i = 0; i < n; ++i) y[r * n + i] = two[2 * r * n + i] + two[(2 * r + 1) * n + i];
      });
    }
  }
  add_biases(mys, plan.prec.size());
}

// A run's rows at float32: the prompt GEMM for a prompt's rows and wherever a matrix is packed (qgemm.cpp reads the
// packed rows), the row kernels otherwise. A model at exact (--exact) takes the GEMM's FMA tiles, bit for bit as before
// AMX; a quantizing model's float32 rows (a prompt scored, every row's logits, and an int8x2 prompt's rows where the
// tiles exist: webchat/kernels/cpu/step.py) its AMX tiles where the CPU has them, whatever the chunk, so a prompt's
// rows are the same bits however it is chunked. AMX cuts the weights into bfloat16 integers once a call (one core,
// the default model's gate: 0.2 ms at any rows), so below 8 rows the FMA tiles would be faster (1 row 0.11 / 0.22 ms,
// 8 rows 0.21 / 0.21, 16 rows 0.33 / 0.24 on the 2-vCPU Xeon); a prompt's chunks are at least 8 rows but its last.
void StepModel::exact_rows(Mats mys, const float* x, const Rows& run, int64_t k) {
  MatRef refs[4];
  int count = 0;
  bool packed = false;
  for (const auto& my : mys) {
    const Mat& w = *my.first;
    refs[count++] = MatRef{w.w, w.n, w.row_bytes, w.qtype, my.second + run.lo * w.n, w.packed};
    packed |= w.packed;
  }
  const int64_t m = run.hi - run.lo;
  if (run.prompt || packed) qgemm_multi(x + run.lo * k, m, k, refs, count, prec != EXACT);
  else qmatmul_multi(x + run.lo * k, m, k, refs, count, xsum2_.data());
}

void StepModel::add_biases(Mats mys, int64_t m) {
  for (const auto& my : mys)
    if (my.first->bias != nullptr)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < my.first->n; ++i) my.second[r * my.first->n + i] += my.first->bias[i];
}

void StepModel::Plan::add(int64_t row, bool prompt, Prec p) {
  const int64_t take = p == INT8X2 ? 2 : p == INT8 ? 1 : 0;
  a8.push_back(take > 0 ? act_rows : -1);
  prec.push_back(p);
  if (runs.empty() || runs.back().prompt != prompt || runs.back().prec != p || runs.back().hi != row)
    runs.push_back(Rows{row, row + 1, prompt, p, act_rows});
  else
    runs.back().hi = row + 1;
  act_rows += take;
}

// act_ shaped for the plan's rows of k values in the forms mys's matrices read (a no-op where every row is exact)
void StepModel::shape_for(Mats mys, const Plan& plan, int64_t k) {
  if (plan.act_rows == 0) return;
  bool blocks = false, supers = false;
  for (const auto& my : mys) blocks |= reads_blocks(my.first->qtype), supers |= reads_supers(my.first->qtype);
  act_.shape(plan.act_rows, k, blocks, supers);
}

void StepModel::quantize_row(const Plan& plan, int64_t r, const float* x) {
  if (plan.prec[r] == INT8) act_.quantize(plan.a8[r], x);
  else if (plan.prec[r] == INT8X2) act_.quantize_pair(plan.a8[r], x);
}

void StepModel::quantize_for(Mats mys, const float* x, const Plan& plan, int64_t k) {
  shape_for(mys, plan, k);
  if (plan.act_rows > 0) each_row(plan.prec.size(), k, [&](int64_t r) { quantize_row(plan, r, x + r * k); });
}

// o_ (T, H, hd): row t of sequence b, query head h attends softmax(cap(scale q k^T)) v over positions
// [0, positions[t]] of b (or [0, key_ends[t]): an image's slots; with a window w: from positions[t] - w + 1), with kv
// head h / (H / n_kv); scale 1 / sqrt(hd) unless the model sets one, cap(s) = c tanh(s / c) where the model soft-caps.
// A window's unit starts at the page of its first row's first key; keys below a row's window get weight 0.
//
// Keys come in segments of SEG_KEYS positions (absolute, whole pages). A row's keys within one segment are one pass
// (scores, their largest m, l = sum exp(s - m), and sum exp(s - m) v); a row with keys in several has its passes folded
// in segment order (fold), so its numbers depend on its own keys only, and one segment gives the single pass's bits.
// The work comes in units of (sequence, query heads, rows, keys): a decoding sequence's one row makes a unit per query
// head while its keys are one segment, split evenly over the threads in order (neighbouring heads share their kv head's
// pages in cache); past one segment, a unit per kv group and segment (every query head of the group reads a page once:
// a long context's pages do not stay in cache between heads), the passes kept in part_ and folded after. A verify
// chunk makes units of up to 8 rows with every query head of one kv group, folding its segments as it goes; where
// units are few (a verify of a few rows: 3 kv groups on 2 threads leave one idle for a third of the work) they take a
// query head each. A prompt's rows make tiles (qattn.h) of 8 or 16 rows with every query head of the group as lanes;
// a tile past one segment makes a unit per kv group and segment like a long decode row, its rows' passes folded after.
// These go to the threads as they come, heaviest first. Each row's sums run in the same order whatever else is in the
// batch and whatever the units.
constexpr int64_t SEG_KEYS = 1024;

namespace {
// (M, L, o): a row's passes folded so far (M = -inf: none); the next segment's (m, l, os) joins them
void fold(float& M, float& L, float* o, float m, float l, const float* os, int64_t hd) {
  if (l == 0.f) return;  // no key of the row in that segment
  if (M == -INFINITY) {
    M = m, L = l;
    std::memcpy(o, os, hd * sizeof(float));
    return;
  }
  const float top = std::max(M, m), a = std::exp(M - top), b = std::exp(m - top);
  L = L * a + l * b;
  for (int64_t c = 0; c < hd; ++c) o[c] = o[c] * a + os[c] * b;
  M = top;
}
}  // namespace

void StepModel::attend(const BatchView& bv, const uint8_t* kc, const uint8_t* vc, const PoolView& kv,
                       int64_t window) {
  const int64_t g = n_heads / n_kv, hd = head_dim, qd = n_heads * hd, ps = kv.page_size;
  const KVKind kind = kv.kind;
  const int64_t slot_bytes = kv.slot_bytes, head_bytes = kv.head_bytes;
  const int64_t rows_f32 = slot_bytes / int64_t(sizeof(float));  // a float32 pool's rows' stride in floats
  const float scale = attn_scale > 0.f ? attn_scale : 1.f / std::sqrt(float(hd)), cap = attn_softcap;
  const bool vec = path() >= PATH_AVX2;
  const auto key_end = [&](int64_t t) { return bv.key_ends != nullptr ? bv.key_ends[t] : bv.positions[t] + 1; };
  const auto key_first = [&](int64_t t) {
    return window > 0 ? std::max<int64_t>(0, bv.positions[t] + 1 - window) : int64_t(0);
  };
  // a q8_0 cache holds H k and H v (kv_format): q . k = (H q / 32) . (H k), and o = H (sum p H v) / 32, so each
  // query row and output row turns once here instead of every key and value row read
  const auto turn = [&](std::vector<float>& rows) {
    if (kind == KV_Q8_0) each_row(bv.t, qd, [&](int64_t t) { hadamard32(rows.data() + t * qd, qd, 1.f / 32.f); });
  };
  turn(q_);
  const int64_t seg = std::max<int64_t>(1, SEG_KEYS / ps) * ps;       // whole pages
  constexpr int64_t ROWS = 8;
  // a prompt's units: 8 rows, or 16 where 8 would leave a tile's 16 lanes part empty (3 query heads a kv head: 48 lanes)
  const int64_t tile_rows = g * ROWS % 16 == 0 ? ROWS : 2 * ROWS;
  struct Unit {
    int64_t b, h0, heads, r0, rows, lmax;
    int64_t s = -1;     // one segment's pass into part_ (a long decode row), or -1: every segment, folded here
    int64_t slot = -1;  // the decode row's place in part_
    bool tiled = false;  // a prompt's rows: qattn.h's tiles
  };
  // a prompt's rows (positions below its prompt_end) take the tiles, every other row the row kernels: a unit holds rows
  // of one kind, so which arithmetic a row gets is the row's own
  const auto prompt_row = [&](int64_t b, int64_t t) {
    return bv.prompt_ends != nullptr && bv.positions[t] < bv.prompt_ends[b];
  };
  std::vector<Unit> single, chunks;
  struct Long {  // a row past one segment (a decode row, or a prompt tile's): its token and segments [s0, s1); its
                 // place in part_ is its index
    int64_t t, s0, s1;
  };
  std::vector<Long> longs;
  int64_t most_segs = 1;  // the most segments of any long row
  for (int64_t b = 0; b < bv.b; ++b) {
    const int64_t lo = bv.query_start[b], hi = bv.query_start[b + 1];
    if (hi - lo == 1) {
      const int64_t end = key_end(lo), s0 = key_first(lo) / seg, s1 = (end + seg - 1) / seg;
      const bool tiled = prompt_row(b, lo);
      if (s1 - s0 <= 1) {
        for (int64_t h = 0; h < n_heads; ++h) single.push_back(Unit{b, h, 1, lo, 1, end, -1, -1, tiled});
        continue;
      }
      most_segs = std::max(most_segs, s1);
      const auto slot = static_cast<int64_t>(longs.size());
      for (int64_t s = s0; s < s1; ++s)
        for (int64_t hk = 0; hk < n_kv; ++hk) chunks.push_back(Unit{b, hk * g, g, lo, 1, end, s, slot, tiled});
      longs.push_back(Long{lo, s0, s1});
      continue;
    }
    int64_t pe = lo;  // the prompt's rows come first
    while (pe < hi && prompt_row(b, pe)) ++pe;
    for (const auto& [from, to, tiled] : {std::tuple(lo, pe, true), std::tuple(pe, hi, false)})
      for (int64_t r0 = from; r0 < to; r0 += tiled ? tile_rows : ROWS) {
        const int64_t rows = std::min(tiled ? tile_rows : ROWS, to - r0);
        int64_t lmax = 0;  // positions rise; an image's slots may see past their own
        for (int64_t t = r0; t < r0 + rows; ++t) lmax = std::max(lmax, key_end(t));
        const int64_t s0 = key_first(r0) / seg, s1 = (lmax + seg - 1) / seg;
        if (!tiled || s1 - s0 <= 1) {
          for (int64_t hk = 0; hk < n_kv; ++hk) chunks.push_back(Unit{b, hk * g, g, r0, rows, lmax, -1, -1, tiled});
          continue;
        }
        // a tile past one segment: a unit per kv group and segment, its rows' passes folded after like a long decode
        // row's (the same folds in the same order), so the threads share the segments and read each while it is in cache
        most_segs = std::max(most_segs, s1);
        const auto slot = static_cast<int64_t>(longs.size());
        for (int64_t s = s0; s < s1; ++s)
          for (int64_t hk = 0; hk < n_kv; ++hk) chunks.push_back(Unit{b, hk * g, g, r0, rows, lmax, s, slot, true});
        for (int64_t t = r0; t < r0 + rows; ++t) longs.push_back(Long{t, s0, s1});
      }
  }
  // few units of row kernels (a verify of a few rows: 3 kv groups on 2 threads leave one idle for a third of the work)
  // take a query head each; a prompt's tiles keep their group's heads as lanes (a head's 16 lanes alone run at half the
  // rate, and read the group's keys three times)
  if (g > 1 && static_cast<int64_t>(chunks.size()) < 8 * at::get_num_threads()) {
    std::vector<Unit> each;
    each.reserve(chunks.size() * g);
    for (const Unit& u : chunks) {
      if (u.tiled) {
        each.push_back(u);
        continue;
      }
      for (int64_t h = 0; h < g; ++h) each.push_back(Unit{u.b, u.h0 + h, 1, u.r0, u.rows, u.lmax, u.s, u.slot, u.tiled});
    }
    chunks.swap(each);
  }
  const auto weight = [&](const Unit& u) { return u.rows * u.heads * (u.s < 0 ? u.lmax : seg); };
  std::stable_sort(chunks.begin(), chunks.end(), [&](const Unit& x, const Unit& y) { return weight(x) > weight(y); });
  // a long decode row's passes: (row slot, head, segment) -> m, l, hd sums
  const int64_t part_row = hd + 2;
  if (!longs.empty()) part_.resize(static_cast<int64_t>(longs.size()) * n_heads * most_segs * part_row);
  const auto part = [&](int64_t slot, int64_t h, int64_t s) {
    return part_.data() + ((slot * n_heads + h) * most_segs + s) * part_row;
  };
  // a page's keys (or values) of one kv head as float32 rows `stride` floats apart: the pool's own floats, or a float16
  // or q8_0 cache's n rows read into buf (once for every query row of the unit)
  auto page_rows = [&](const uint8_t* cache, int64_t page, int64_t hk, int64_t n, std::vector<float>& buf,
                       int64_t& stride) -> const float* {
    const uint8_t* base = cache + page * ps * slot_bytes + hk * head_bytes;
    if (kind == KV_F32) return stride = rows_f32, reinterpret_cast<const float*>(base);
    if (static_cast<int64_t>(buf.size()) < ps * hd) buf.resize(ps * hd);
    if (vec) load_rows_avx2(kind, base, slot_bytes, n, hd, buf.data());
    else load_rows_scalar(kind, base, slot_bytes, n, hd, buf.data());
    return stride = hd, buf.data();
  };
  // query row j of a unit: head h0 + j / rows, token r0 + j % rows
  const auto tok = [](const Unit& U, int64_t j) { return U.r0 + j % U.rows; };
  const auto head = [](const Unit& U, int64_t j) { return U.h0 + j / U.rows; };
  const auto o = [&](const Unit& U, int64_t j) { return o_.data() + tok(U, j) * qd + head(U, j) * hd; };
  // one pass of the unit's rows over keys [a, e) (a whole page): m[j], l[j] (0 where row j has no key there) and
  // out(j) = sum exp(s - m[j]) v
  // the same pass on qattn.h's tiles: the unit's rows as lanes of qt (d-major), scores key-major in sc
  const auto tiles = [&](const Unit& U, int64_t a, int64_t e, float* m, float* l, auto out) {
    static thread_local std::vector<float> qt, sc, rows_buf, mt, lt;
    static thread_local std::vector<int32_t> first, last;
    static thread_local std::vector<float*> outs;
    const int64_t n_rows = U.heads * U.rows, hk = U.h0 / g, L = (n_rows + 15) / 16 * 16, p = path();
    const int64_t base = std::max(a, key_first(U.r0) / ps * ps), width = std::max<int64_t>(0, e - base);
    qt.assign(hd * L, 0.f), first.assign(L, 0), last.assign(L, 0), mt.resize(L), lt.resize(L), outs.resize(n_rows);
    for (int64_t j = 0; j < n_rows; ++j) {
      const float* qj = q_.data() + tok(U, j) * qd + head(U, j) * hd;
      for (int64_t d = 0; d < hd; ++d) qt[d * L + j] = qj[d];
      first[j] = static_cast<int32_t>(std::max(key_first(tok(U, j)), base));
      last[j] = static_cast<int32_t>(std::min(key_end(tok(U, j)), e));
      outs[j] = out(j);
      std::fill(outs[j], outs[j] + hd, 0.f);
    }
    if (static_cast<int64_t>(sc.size()) < width * L) sc.resize(width * L);
    const int32_t* pages = bv.block_tables + U.b * bv.width;
    int64_t st = rows_f32;
    const auto ahead = [&](const uint8_t* cache, int64_t pos0) {  // the next page's first rows, where the pool is f32
      if (kind == KV_F32 && pos0 + ps < e)
        prefetch_rows(reinterpret_cast<const float*>(cache + pages[pos0 / ps + 1] * ps * slot_bytes + hk * head_bytes),
                      rows_f32, std::min<int64_t>(8, e - pos0 - ps), hd);
    };
    for (int64_t pos0 = base; pos0 < e; pos0 += ps) {
      const int64_t n = std::min(ps, e - pos0);
      const float* kp = page_rows(kc, pages[pos0 / ps], hk, n, rows_buf, st);
      ahead(kc, pos0);
      tile_scores(p, qt.data(), L, hd, kp, st, n, scale, sc.data() + (pos0 - base) * L);
    }
    tile_softmax(p, sc.data(), L, width, base, first.data(), last.data(), cap, mt.data(), lt.data());
    for (int64_t j = 0; j < n_rows; ++j) m[j] = mt[j], l[j] = lt[j];
    for (int64_t pos0 = base; pos0 < e; pos0 += VALUE_PAGES * ps) {  // VALUE_PAGES pages a call
      static thread_local std::vector<float> value_bufs[VALUE_PAGES];
      const float* vps[VALUE_PAGES];
      int64_t ns[VALUE_PAGES];
      int np = 0;
      for (int64_t at = pos0; at < e && np < VALUE_PAGES; at += ps, ++np) {
        ns[np] = std::min(ps, e - at);
        vps[np] = page_rows(vc, pages[at / ps], hk, ns[np], value_bufs[np], st);
      }
      ahead(vc, pos0 + (np - 1) * ps);
      tile_values(p, sc.data() + (pos0 - base) * L, L, n_rows, np, vps, ns, st, hd, outs.data());
    }
  };
  const auto pass = [&](const Unit& U, int64_t a, int64_t e, float* m, float* l, auto out) {
    if (U.tiled) return tiles(U, a, e, m, l, out);
    static thread_local std::vector<float> sc, rows_buf;
    const int64_t n_rows = U.heads * U.rows, hk = U.h0 / g;
    const int p = path();
    const int64_t base = std::max(a, key_first(U.r0) / ps * ps), width = std::max<int64_t>(0, e - base);
    if (static_cast<int64_t>(sc.size()) < n_rows * width) sc.resize(n_rows * width);
    const int32_t* pages = bv.block_tables + U.b * bv.width;
    const auto hi = [&](int64_t j) { return std::min(key_end(tok(U, j)), e); };  // the row's last key here, + 1
    int64_t st = rows_f32;  // the stride of the page's rows as read
    thread_local std::vector<float*> outs;  // a token's rows, one a head, for row_scores and row_values
    thread_local std::vector<const float*> ws;
    outs.resize(U.heads), ws.resize(U.heads);
    for (int64_t pos0 = base; pos0 < e; pos0 += ps) {  // scores, a token's heads together (qattn_rows.cpp)
      const float* kp = page_rows(kc, pages[pos0 / ps], hk, std::min(ps, e - pos0), rows_buf, st);
      for (int64_t r = 0; r < U.rows; ++r) {  // row x * rows + r: head h0 + x's row of token r0 + r
        for (int64_t x = 0; x < U.heads; ++x) outs[x] = sc.data() + (x * U.rows + r) * width + (pos0 - base);
        row_scores(p, q_.data() + (U.r0 + r) * qd + U.h0 * hd, U.heads, hd, kp, st, std::min(ps, hi(r) - pos0), scale,
                   outs.data());
      }
    }
    for (int64_t j = 0; j < n_rows; ++j) {  // softmax numerators over the row's keys here, their largest and sum
      float* sj = sc.data() + j * width - base;  // indexed by position
      const int64_t lo = std::max(key_first(tok(U, j)), base), end = hi(j), n = end - lo;
      std::fill(out(j), out(j) + hd, 0.f);
      if (n <= 0) {
        m[j] = -INFINITY, l[j] = 0.f;
        std::fill(sj + base, sj + e, 0.f);
        continue;
      }
      if (cap > 0.f)
        for (int64_t i = lo; i < end; ++i) sj[i] = std::tanh(sj[i] / cap) * cap;
      m[j] = vec ? max_avx2(sj + lo, n) : *std::max_element(sj + lo, sj + end);
      l[j] = vec ? exp_sum_avx2(sj + lo, n, m[j]) : exp_sum_scalar(sj + lo, n, m[j]);
      std::fill(sj + base, sj + lo, 0.f);  // keys before the window
    }
    for (int64_t pos0 = base; pos0 < e; pos0 += ps) {  // out = sum p v
      const float* vp = page_rows(vc, pages[pos0 / ps], hk, std::min(ps, e - pos0), rows_buf, st);
      for (int64_t r = 0; r < U.rows; ++r) {
        for (int64_t x = 0; x < U.heads; ++x)
          outs[x] = out(x * U.rows + r), ws[x] = sc.data() + (x * U.rows + r) * width + (pos0 - base);
        row_values(p, outs.data(), ws.data(), U.heads, hd, vp, st, std::min(ps, hi(r) - pos0));
      }
    }
  };
  const auto scale_by = [&](float* oj, float sum) {  // o / l: the softmax's denominator, once the sums are in
    const float inv = 1.f / sum;
    for (int64_t c = 0; c < hd; ++c) oj[c] *= inv;
  };
  auto run = [&](const Unit& U) {
    static thread_local std::vector<float> ms, ls, big_m, big_l, tmp;
    const int64_t n_rows = U.heads * U.rows;
    ms.resize(n_rows), ls.resize(n_rows);
    if (U.s >= 0) {  // a long row's segment (a decode row, or a prompt's tile): its pass into part_
      pass(U, U.s * seg, std::min(U.lmax, (U.s + 1) * seg), ms.data(), ls.data(),
           [&](int64_t j) { return part(U.slot + j % U.rows, head(U, j), U.s) + 2; });
      for (int64_t j = 0; j < n_rows; ++j) {
        float* p = part(U.slot + j % U.rows, head(U, j), U.s);
        p[0] = ms[j], p[1] = ls[j];
      }
      return;
    }
    const int64_t s0 = key_first(U.r0) / seg, s1 = (U.lmax + seg - 1) / seg;
    if (s1 - s0 <= 1) {  // one segment: the pass straight into o, then 1 / l
      pass(U, s0 * seg, U.lmax, ms.data(), ls.data(), [&](int64_t j) { return o(U, j); });
      for (int64_t j = 0; j < n_rows; ++j) scale_by(o(U, j), ls[j]);
      return;
    }
    big_m.assign(n_rows, -INFINITY), big_l.assign(n_rows, 0.f), tmp.resize(n_rows * hd);
    for (int64_t s = s0; s < s1; ++s) {
      pass(U, s * seg, std::min(U.lmax, (s + 1) * seg), ms.data(), ls.data(),
           [&](int64_t j) { return tmp.data() + j * hd; });
      for (int64_t j = 0; j < n_rows; ++j) fold(big_m[j], big_l[j], o(U, j), ms[j], ls[j], tmp.data() + j * hd, hd);
    }
    for (int64_t j = 0; j < n_rows; ++j) scale_by(o(U, j), big_l[j]);
  };
  if (!single.empty())
    at::parallel_for(0, static_cast<int64_t>(single.size()), 1, [&](int64_t a, int64_t e) {
      for (int64_t u = a; u < e; ++u) run(single[u]);
    });
  if (!chunks.empty()) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t u = next++; u < static_cast<int64_t>(chunks.size()); u = next++) run(chunks[u]);
    });
  }
  const auto n_long = static_cast<int64_t>(longs.size() * n_heads);
  // long rows' passes: a decode step's few (rows x heads) folded on this thread, a prompt chunk's thousands split
  at::parallel_for(0, n_long, 256, [&](int64_t a, int64_t e) {
    for (int64_t x = a; x < e; ++x) {
      const int64_t slot = x / n_heads, h = x % n_heads;
      const Long& r = longs[slot];
      float M = -INFINITY, L = 0.f;
      float* oh = o_.data() + r.t * qd + h * hd;
      for (int64_t s = r.s0; s < r.s1; ++s) {  // in order
        const float* p = part(slot, h, s);
        fold(M, L, oh, p[0], p[1], p + 2, hd);
      }
      scale_by(oh, L);
    }
  });
  turn(o_);
}

void StepModel::forward(const BatchView& bv, const PoolView& kv, const float* cos, const float* sin,
                        const float* cos_l, const float* sin_l, int64_t n_layers, float* logits) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t T = bv.t, d = dim, qd = n_heads * head_dim, kvd = n_kv * head_dim, half = head_dim / 2;
  const int64_t widest = std::max({d, qd, ffn});
  const int64_t rows = std::max(T, bv.r);
  x_.resize(T * d), y_.resize(rows * std::max(d, qd)), q_.resize(T * qd), k_.resize(T * kvd), v_.resize(T * kvd);
  o_.resize(T * qd), g_.resize(T * ffn), u_.resize(T * ffn), out_.resize(T * d);
  xsum2_.resize(rows * (widest / 32 + 1) * 2);
  float *x = x_.data(), *y = y_.data(), *q = q_.data(), *k = k_.data(), *v = v_.data(), *o = o_.data();
  float *g = g_.data(), *u = u_.data(), *out = out_.data();

  // each row's precision: its sequence's exact flag, else the prompt's or the other rows'; the token rows in runs of
  // one kind (a sequence's prompt rows come first, then any others), the logit rows as their token rows
  tokens_ = Plan{}, logits_ = Plan{};
  for (int64_t b = 0; b < bv.b; ++b)
    for (int64_t t = bv.query_start[b]; t < bv.query_start[b + 1]; ++t) {
      const bool prompt = bv.prompt_ends != nullptr && bv.positions[t] < bv.prompt_ends[b];
      const bool exact = prompt && bv.exact != nullptr && bv.exact[b] != 0;  // a prompt scored: its rows
      tokens_.add(t, prompt, exact ? EXACT : prompt ? prompt_prec : prec);
    }
  for (int64_t r = 0; r < bv.r; ++r) logits_.add(r, false, tokens_.prec[bv.logit_rows[r]]);
  std::vector<uint8_t> gathered(emb.packed ? emb.row_bytes : 0);
  for (int64_t t = 0; t < T; ++t) {  // a packed table (a tied head at int8) gives each row's bytes back first
    const uint8_t* row = emb.w + bv.tokens[t] * emb.row_bytes;
    if (emb.packed) packed_row(emb.qtype, emb.w, emb.row_bytes, bv.tokens[t], gathered.data()), row = gathered.data();
    dequant_row(emb.qtype, row, d, x + t * d);
  }
  if (embed_scale != 1.f)
    for (int64_t c = 0; c < T * d; ++c) x[c] *= embed_scale;
  for (int64_t i = 0; i < bv.e; ++i) std::memcpy(x + bv.embed_rows[i] * d, bv.embeds + i * d, d * sizeof(float));
  // y = rms_norm(x rows) with w, each row's 8-bit form made as it is written (int8) for the matrices that read it
  const auto norm_rows = [&](const float* w, Mats next) {
    shape_for(next, tokens_, d);
    each_row(T, d, [&](int64_t t) {
      rms_norm_row(x + t * d, w, y + t * d, d, eps);
      quantize_row(tokens_, t, y + t * d);
    });
  };
  const bool avx2 = path() >= PATH_AVX2;
  for (int64_t i = 0; i < n_layers; ++i) {
    const Layer& L = layers[i];
    norm_rows(L.attn_norm, {{&L.wq, q}, {&L.wk, k}, {&L.wv, v}});
    linears({{&L.wq, q}, {&L.wk, k}, {&L.wv, v}}, y, tokens_);
    const bool local = L.local_rope && cos_l != nullptr;
    for (int64_t t = 0; t < T; ++t) {
      const float* c = (local ? cos_l : cos) + bv.positions[t] * half;
      const float* s = (local ? sin_l : sin) + bv.positions[t] * half;
      if (L.q_norm != nullptr) {  // per head, in place (rms_norm_row reads a value before it writes it)
        for (int64_t h = 0; h < n_heads; ++h) {
          float* qh = q + t * qd + h * head_dim;
          rms_norm_row(qh, L.q_norm, qh, head_dim, eps);
        }
        for (int64_t h = 0; h < n_kv; ++h) {
          float* kh = k + t * kvd + h * head_dim;
          rms_norm_row(kh, L.k_norm, kh, head_dim, eps);
        }
      }
      rope_heads(q + t * qd, n_heads, head_dim, c, s);
      rope_heads(k + t * kvd, n_kv, head_dim, c, s);
      for (int64_t h = 0; h < n_kv; ++h) {  // into the pool as it stores a row
        const int64_t at = bv.slots[t] * kv.slot_bytes + h * kv.head_bytes;
        store_row(kv.kind, k + t * kvd + h * head_dim, head_dim, kv.k[i] + at);
        store_row(kv.kind, v + t * kvd + h * head_dim, head_dim, kv.v[i] + at);
      }
    }
    attend(bv, kv.k[i], kv.v[i], kv, L.window);
    quantize_for({{&L.wo, out}}, o, tokens_, qd);
    linears({{&L.wo, out}}, o, tokens_);
    if (L.attn_post_norm != nullptr)
      for (int64_t t = 0; t < T; ++t) rms_norm_row(out + t * d, L.attn_post_norm, out + t * d, d, eps);
    for (int64_t c = 0; c < T * d; ++c) x[c] += out[c];
    norm_rows(L.ffn_norm, {{&L.w1, g}, {&L.w3, u}});
    linears({{&L.w1, g}, {&L.w3, u}}, y, tokens_);
    if (tokens_.act_rows > 0) {
      shape_for({{&L.w2, out}}, tokens_, ffn);
      each_row(T, ffn, [&](int64_t t) {  // g = act(g) * u a row at a time, and its 8-bit form while in cache
        float* gt = g + t * ffn;
        const float* ut = u + t * ffn;
        if (gelu) avx2 ? gelu_mul_avx2(gt, ut, ffn) : gelu_mul_scalar(gt, ut, ffn);
        else avx2 ? silu_mul_avx2(gt, ut, ffn) : silu_mul_scalar(gt, ut, ffn);
        quantize_row(tokens_, t, gt);
      });
    } else if (gelu) {
      avx2 ? gelu_mul_avx2(g, u, T * ffn) : gelu_mul_scalar(g, u, T * ffn);
    } else {
      avx2 ? silu_mul_avx2(g, u, T * ffn) : silu_mul_scalar(g, u, T * ffn);
    }
    linears({{&L.w2, out}}, g, tokens_);
    if (L.ffn_post_norm != nullptr)
      for (int64_t t = 0; t < T; ++t) rms_norm_row(out + t * d, L.ffn_post_norm, out + t * d, d, eps);
    for (int64_t c = 0; c < T * d; ++c) x[c] += out[c];
  }
  shape_for({{&head, logits}}, logits_, d);
  for (int64_t r = 0; r < bv.r; ++r) {
    rms_norm_row(x + bv.logit_rows[r] * d, final_norm, y + r * d, d, eps);
    quantize_row(logits_, r, y + r * d);
  }
  linears({{&head, logits}}, y, logits_);
}

}  // namespace wq
