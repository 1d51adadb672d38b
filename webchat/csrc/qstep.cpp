// One decode step of a Llama-family model in C++: every layer for one token at position pos, float32 activations,
// quantized matrices through qmatmul_raw. The same maths as webchat.model.Transformer.layers_forward:
//   h = x + attn(rms_norm(x)), x' = h + w2(silu(w1 y) * w3 y) with y = rms_norm(h); logits = head(rms_norm(x_L))
// Only the Python overhead around ~10 small ops per layer goes away; the numbers are float32 throughout.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "qcommon.h"
#include "qstep.h"

namespace wq {

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

void StepModel::linear(const Mat& m, const float* x, float* y) const {
  const MatRef r{m.w, m.n, m.row_bytes, m.qtype, y};
  qgemv_multi(x, m.k, &r, 1, xsum2_.data());
  if (m.bias != nullptr)
    for (int64_t i = 0; i < m.n; ++i) y[i] += m.bias[i];
}

// y_i = x @ m_i^T (+ bias_i) for matrices sharing x and K, in one parallel region
void StepModel::linears(std::initializer_list<std::pair<const Mat*, float*>> mys, const float* x) const {
  MatRef refs[4];
  int count = 0;
  for (const auto& my : mys) refs[count++] = MatRef{my.first->w, my.first->n, my.first->row_bytes, my.first->qtype,
                                                    my.second};
  qgemv_multi(x, mys.begin()->first->k, refs, count, xsum2_.data());
  for (const auto& my : mys)
    if (my.first->bias != nullptr)
      for (int64_t i = 0; i < my.first->n; ++i) my.second[i] += my.first->bias[i];
}

// o (H, hd) = softmax(q k^T / sqrt(hd)) v over cache positions [0, len) of each head's kv group
void StepModel::attend(const float* q, const float* ck, const float* cv, int64_t cap, int64_t len, float* o) const {
  const int64_t group = n_heads / n_kv;
  const float scale = 1.f / std::sqrt(float(head_dim));
  at::parallel_for(0, n_heads, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> p(len);
    for (int64_t h = h0; h < h1; ++h) {
      const float* qh = q + h * head_dim;
      const float* kh = ck + (h / group) * cap * head_dim;  // (cap, hd) of this head's kv group
      const float* vh = cv + (h / group) * cap * head_dim;
      float mx = -INFINITY;
      for (int64_t t = 0; t < len; ++t) {
        float s = 0.f;
        for (int64_t e = 0; e < head_dim; ++e) s += qh[e] * kh[t * head_dim + e];
        p[t] = s * scale;
        mx = std::max(mx, p[t]);
      }
      float sum = 0.f;
      for (int64_t t = 0; t < len; ++t) sum += (p[t] = std::exp(p[t] - mx));
      float* oh = o + h * head_dim;
      for (int64_t e = 0; e < head_dim; ++e) oh[e] = 0.f;
      for (int64_t t = 0; t < len; ++t) {
        const float pt = p[t] / sum;
        for (int64_t e = 0; e < head_dim; ++e) oh[e] += pt * vh[t * head_dim + e];
      }
    }
  });
}

void StepModel::step(int64_t token, int64_t pos, float* const* cache_k, float* const* cache_v, int64_t cap,
                     const float* cos, const float* sin, float* logits) {
  const int64_t d = dim, qd = n_heads * head_dim, kvd = n_kv * head_dim;
  const int64_t widest = std::max({d, qd, ffn, head.k});
  xsum2_.resize(widest / 32 * 2 + 2);
  std::vector<float> x(d), y(std::max(d, qd)), q(qd), k(kvd), v(kvd), o(qd), g(ffn), u(ffn), out(d);
  dequant_row(emb, token, x.data());
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& L = layers[i];
    rms_norm_row(x.data(), L.attn_norm, y.data(), d, eps);
    linears({{&L.wq, q.data()}, {&L.wk, k.data()}, {&L.wv, v.data()}}, y.data());
    rope_heads(q.data(), n_heads, head_dim, cos, sin);
    rope_heads(k.data(), n_kv, head_dim, cos, sin);
    for (int64_t h = 0; h < n_kv; ++h) {  // cache (n_kv, cap, hd) <- k, v at pos
      std::copy_n(k.data() + h * head_dim, head_dim, cache_k[i] + (h * cap + pos) * head_dim);
      std::copy_n(v.data() + h * head_dim, head_dim, cache_v[i] + (h * cap + pos) * head_dim);
    }
    attend(q.data(), cache_k[i], cache_v[i], cap, pos + 1, o.data());
    linear(L.wo, o.data(), out.data());
    for (int64_t c = 0; c < d; ++c) x[c] += out[c];
    rms_norm_row(x.data(), L.ffn_norm, y.data(), d, eps);
    linears({{&L.w1, g.data()}, {&L.w3, u.data()}}, y.data());
    for (int64_t c = 0; c < ffn; ++c) g[c] = g[c] / (1.f + std::exp(-g[c])) * u[c];  // silu(g) * u
    linear(L.w2, g.data(), out.data());
    for (int64_t c = 0; c < d; ++c) x[c] += out[c];
  }
  rms_norm_row(x.data(), final_norm, y.data(), d, eps);
  linear(head, y.data(), logits);
}

// one row of a quantized matrix as floats
void StepModel::dequant_row(const Mat& m, int64_t row, float* out) const {
  const uint8_t* r = m.w + row * m.row_bytes;
  const int bb = m.qtype == Q4_0 ? 18 : m.qtype == Q4_1 ? 20 : 34;
  for (int64_t b = 0; b < m.k / 32; ++b) {
    const uint8_t* blk = r + b * bb;
    const float dd = half_to_float(blk);
    float* o = out + b * 32;
    if (m.qtype == Q8_0) {
      const int8_t* qq = reinterpret_cast<const int8_t*>(blk + 2);
      for (int i = 0; i < 32; ++i) o[i] = dd * float(qq[i]);
    } else {
      const uint8_t* qq = blk + (m.qtype == Q4_1 ? 4 : 2);
      const float mn = m.qtype == Q4_1 ? half_to_float(blk + 2) : 0.f;
      const float off = m.qtype == Q4_1 ? 0.f : 8.f;
      for (int i = 0; i < 16; ++i) {
        o[i] = dd * (float(qq[i] & 15) - off) + mn;
        o[i + 16] = dd * (float(qq[i] >> 4) - off) + mn;
      }
    }
  }
}

}  // namespace wq
