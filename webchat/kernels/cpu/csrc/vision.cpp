// The vision encoder (docs/vision.md) as one call: SigLIP over a batch of tiles, then the projector.
//
//   x = im2col(pixels) W_patch^T + b_patch + pos                       (M = N P rows of D)
//   per layer: h = ln1(x); qkv = h W_qkv^T + b; a = softmax(q k^T / sqrt(hd)) v over each tile's P patches
//              x += a W_o^T + b_o; h = ln2(x); x += gelu_tanh(h W_up^T + b_up) W_down^T + b_down (the GELU applied as
//              the up projection's output is written, where the AMX GEMM runs)
//   x = post_ln(x)
//   idefics3: y = shuffle_s(x) W_fc^T;  gemma3: y = rms(avgpool_s(x)) * w W_proj
//
// A matrix is float32 (exact), or Q8_0 blocks (int8: each input row quantized to 8 bits with a scale per 8 values,
// Act8, and the Q8_0 GEMM of qgemm8b.cpp, float32 per 8-value group). An exact matrix whose values are each a sum of
// two bfloat16 (the file's F16 or BF16 weights) takes the split-bfloat16 GEMM on AMX where it runs (vgemm.cpp: about
// 1e-5 relative to float32), any other torch's sgemm on the weights converted once at load. Attention is torch's CPU
// flash-attention kernel in float32 on both paths. Every parallel loop is at::parallel_for on torch's OpenMP team;
// torch's sgemm, attention and brgemm calls run on the same team.
#include "vision.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

#include "qcommon.h"
#include "qint8.h"
#include "vgemm.h"

namespace wq {

namespace {

constexpr int64_t Q8_BYTES = 34;
constexpr int64_t PANEL_ROWS = 256;  // x rows a Q8_0 panel holds (~200 KB at k = 768: in L2 while the weights pass)
constexpr int64_t W_ROWS = 64;       // weight rows a task

struct VMat {
  torch::Tensor w;     // F32: (n, k) float32; Q8_0: (n, k / 32 * 34) uint8
  torch::Tensor wt;    // F32: w^T, a view (k, n)
  torch::Tensor bias;  // (n) float32, or undefined
  int qtype = F32;
  int64_t n = 0, k = 0;
  bool amx = false;  // F32 taken as bfloat16 pieces on AMX (split)
  SplitMat split;
};

VMat make_mat(const torch::Tensor& w, int64_t qtype, const torch::Tensor& bias, const char* what, bool amx = false) {
  VMat m;
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), what, ": expected a contiguous 2-d matrix, got ", w.sizes());
  m.qtype = static_cast<int>(qtype), m.w = w, m.n = w.size(0);
  if (qtype == F32) {
    TORCH_CHECK(w.scalar_type() == torch::kFloat32, what, ": an F32 matrix must be float32, got ", w.scalar_type());
    m.k = w.size(1), m.wt = w.t();
    if (amx && split_pack(w, m.split)) {
      m.amx = true;
      m.w = m.wt = torch::Tensor();
    }
  } else {
    TORCH_CHECK(qtype == Q8_0 && w.scalar_type() == torch::kUInt8 && w.size(1) % Q8_BYTES == 0, what,
                ": expected float32 (ggml type 0) or Q8_0 blocks (8) as uint8 rows of 34-byte blocks; got type ", qtype,
                " ", w.scalar_type(), " ", w.sizes());
    m.k = w.size(1) / Q8_BYTES * 32;
  }
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == torch::kFloat32 && bias.numel() == m.n && bias.is_contiguous(), what,
                ": bias must be float32 of ", m.n, ", got ", bias.sizes());
    m.bias = bias;
  }
  return m;
}

// y (M, n) = x (M, k) W^T (+ bias): rows of x in panels of PANEL_ROWS, tasks of (panel, W_ROWS weight rows)
void gemm_q8(const torch::Tensor& x, const VMat& m, torch::Tensor& y, Act8& act) {
  const int64_t M = x.size(0);
  act.shape(M, m.k, true, false);
  act.quantize_rows(x.data_ptr<float>(), m.k);
  const int p = path();
  const int64_t panels = (M + PANEL_ROWS - 1) / PANEL_ROWS, blocks = (m.n + W_ROWS - 1) / W_ROWS;
  std::vector<PanelB> panel(panels);
  if (p >= PATH_AVX2)
    at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) panel[c].build(act, c * PANEL_ROWS, std::min(PANEL_ROWS, M - c * PANEL_ROWS));
    });
  const uint8_t* w = m.w.data_ptr<uint8_t>();
  const int64_t row_bytes = m.w.size(1);
  float* out = y.data_ptr<float>();
  at::parallel_for(0, panels * blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t c = t / blocks, n0 = t % blocks * W_ROWS, r0 = c * PANEL_ROWS;
      q8_gemm_rows(act, panel[c], r0, std::min(PANEL_ROWS, M - r0), w, row_bytes, n0, std::min(m.n, n0 + W_ROWS),
                   out + r0 * m.n, m.n, p);
    }
  });
  if (m.bias.defined()) y.add_(m.bias);
}

// gelu (tanh) in place: 16 lanes where the CPU has AVX-512 (gelu_span), torch's otherwise
void gelu_tanh(torch::Tensor& u) {
  if (!gelu_wide()) {
    at::gelu_(u, "tanh");
    return;
  }
  float* x = u.data_ptr<float>();
  at::parallel_for(0, u.numel(), 16384, [&](int64_t b, int64_t e) { gelu_span(x + b, e - b); });
}

// y = x W^T + bias (y preallocated (M, n)); gelu: y = gelu_tanh(y) (in the AMX GEMM's tiles where it runs)
void linear(const torch::Tensor& x, const VMat& m, torch::Tensor& y, Act8& act, bool gelu = false) {
  TORCH_CHECK(x.size(1) == m.k, "a matrix of k = ", m.k, " was given rows of ", x.size(1));
  if (m.amx) {
    split_gemm(x.data_ptr<float>(), x.size(0), m.split, m.bias.defined() ? m.bias.data_ptr<float>() : nullptr,
               y.data_ptr<float>(), gelu);
    return;
  }
  if (m.qtype == F32) {
    if (m.bias.defined()) {
      at::addmm_out(y, m.bias, x, m.wt);
    } else {
      at::mm_out(y, x, m.wt);
    }
  } else {
    gemm_q8(x, m, y, act);
  }
  if (gelu) gelu_tanh(y);
}

// x += t (if given); h = (x - mean) / sqrt(var + eps) * w + wb, row by row
void add_layer_norm(float* x, const float* t, const float* w, const float* wb, float* h, int64_t M, int64_t D,
                    double eps) {
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* xr = x + r * D;
      if (t != nullptr)
        for (int64_t i = 0; i < D; ++i) xr[i] += t[r * D + i];
      double sum = 0;
      for (int64_t i = 0; i < D; ++i) sum += xr[i];
      const double mean = sum / D;
      double sq = 0;
      for (int64_t i = 0; i < D; ++i) sq += (xr[i] - mean) * (xr[i] - mean);
      const float rstd = static_cast<float>(1.0 / std::sqrt(sq / D + eps)), mu = static_cast<float>(mean);
      float* hr = h + r * D;
      for (int64_t i = 0; i < D; ++i) hr[i] = (xr[i] - mu) * rstd * w[i] + wb[i];
    }
  });
}

enum Phase { EMBED, NORMS, MATMULS, ATTENTION, PROJECT, PHASES };  // MATMULS: the MLP's GELU too

// the time since the last lap, added to a phase's total (under the tower's lock: forwards may run at once)
struct Clock {
  std::vector<double>& total;
  std::mutex& lock;
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  Clock(std::vector<double>& t, std::mutex& m) : total(t), lock(m) {}
  void lap(Phase p) {
    const auto now = std::chrono::steady_clock::now();
    const std::lock_guard<std::mutex> held(lock);
    total[p] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

}  // namespace

// One projector's weights, converted once; forward(pixels) runs every tile through the tower and the projector.
class VisionTower {
 public:
  // dims: kind (0 idefics3, 1 gemma3), image_size, patch, D, F, layers, heads, T, scale
  // embed: patch weight (D, 3 p p) float32, patch bias (D), positions (P, D), post_ln weight, bias; gemma3: norm (D)
  // norms: per layer ln1 weight, bias, ln2 weight, bias; mats: per layer qkv (3D, D), out, up, down, then the
  // projection (T, D s^2) or gemma3's (T, D); qtypes: each matrix's (0 F32, 8 Q8_0); biases: per layer qkv, out, up,
  // down; amx: F32 matrices that split exactly into two bfloat16 take the AMX GEMM where it runs
  VisionTower(std::vector<int64_t> dims, double eps, std::vector<torch::Tensor> embed, std::vector<torch::Tensor> norms,
              std::vector<torch::Tensor> mats, std::vector<int64_t> qtypes, std::vector<torch::Tensor> biases,
              bool amx)
      : eps_(eps), embed_(std::move(embed)), norms_(std::move(norms)) {
    amx = amx && amx_bf16();
    TORCH_CHECK(dims.size() == 9, "dims: expected 9 values, got ", dims.size());
    kind_ = dims[0], S_ = dims[1], p_ = dims[2], D_ = dims[3], F_ = dims[4], L_ = dims[5], H_ = dims[6], T_ = dims[7];
    s_ = dims[8];
    TORCH_CHECK(S_ % p_ == 0 && D_ % H_ == 0 && (S_ / p_) % s_ == 0, "inconsistent dims");
    side_ = S_ / p_, P_ = side_ * side_;
    const int64_t want_mats = 4 * L_ + 1;
    TORCH_CHECK(static_cast<int64_t>(mats.size()) == want_mats && static_cast<int64_t>(qtypes.size()) == want_mats &&
                    static_cast<int64_t>(biases.size()) == 4 * L_ && static_cast<int64_t>(norms_.size()) == 4 * L_ &&
                    embed_.size() == (kind_ == 1 ? 6u : 5u),
                "expected ", want_mats, " matrices and types, ", 4 * L_, " biases and norms, got ", mats.size(), ", ",
                qtypes.size(), ", ", biases.size(), ", ", norms_.size());
    const int64_t want_n[4] = {3 * D_, D_, F_, D_}, want_k[4] = {D_, D_, D_, F_};
    for (int64_t i = 0; i < 4 * L_; ++i) {
      mats_.push_back(make_mat(mats[i], qtypes[i], biases[i], "a layer matrix", amx));
      TORCH_CHECK(mats_.back().n == want_n[i % 4] && mats_.back().k == want_k[i % 4], "layer ", i / 4, " matrix ",
                  i % 4, ": expected ", want_n[i % 4], " x ", want_k[i % 4], ", got ", mats_.back().n, " x ",
                  mats_.back().k);
    }
    proj_ = make_mat(mats[4 * L_], qtypes[4 * L_], torch::Tensor(), "the projection", amx);
    TORCH_CHECK(proj_.n == T_ && proj_.k == (kind_ == 0 ? D_ * s_ * s_ : D_), "projection: expected ", T_, " rows");
    patch_ = make_mat(embed_[0], F32, embed_[1], "the patch embedding", amx);
    TORCH_CHECK(patch_.n == D_ && patch_.k == 3 * p_ * p_ && embed_[2].numel() == P_ * D_, "patch embedding shapes");
  }

  int64_t tokens_per_tile() const { return (side_ / s_) * (side_ / s_); }

  // how many matrices take the AMX GEMM (the patch embedding, the layers' and the projection)
  int64_t amx_matrices() const {
    int64_t count = patch_.amx + proj_.amx;
    for (const VMat& m : mats_) count += m.amx;
    return count;
  }

  torch::Tensor forward(const torch::Tensor& pixels) {
    TORCH_CHECK(pixels.dim() == 4 && pixels.size(1) == 3 && pixels.size(2) == S_ && pixels.size(3) == S_ &&
                    pixels.scalar_type() == torch::kFloat32,
                "pixels: expected float32 (N, 3, ", S_, ", ", S_, "), got ", pixels.scalar_type(), " ", pixels.sizes());
    const torch::Tensor px = pixels.contiguous();
    const int64_t N = px.size(0), M = N * P_;
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    torch::Tensor x = torch::empty({M, D_}, f32), h = torch::empty({M, D_}, f32), t = torch::empty({M, D_}, f32);
    torch::Tensor qkv = torch::empty({M, 3 * D_}, f32), u = torch::empty({M, F_}, f32);
    Act8 act;  // this call's 8-bit rows (int8 matrices); a tower may run on several threads at once
    Clock clock(seconds_, seconds_lock_);
    embed(px, x, act);
    clock.lap(EMBED);
    for (int64_t l = 0; l < L_; ++l) {  // t holds the last layer's MLP output (with its bias) until ln1 adds it
      add_layer_norm(x.data_ptr<float>(), l > 0 ? t.data_ptr<float>() : nullptr, norm(l, 0), norm(l, 1),
                     h.data_ptr<float>(), M, D_, eps_);
      clock.lap(NORMS);
      linear(h, mats_[4 * l], qkv, act);
      clock.lap(MATMULS);
      attention(qkv, N, t);
      clock.lap(ATTENTION);
      linear(t, mats_[4 * l + 1], h, act);  // h: the attention's output projected (ln1's h is spent)
      clock.lap(MATMULS);
      add_layer_norm(x.data_ptr<float>(), h.data_ptr<float>(), norm(l, 2), norm(l, 3), t.data_ptr<float>(), M, D_,
                     eps_);
      clock.lap(NORMS);
      linear(t, mats_[4 * l + 2], u, act, true);
      clock.lap(MATMULS);
      linear(u, mats_[4 * l + 3], t, act);
      clock.lap(MATMULS);
    }
    add_layer_norm(x.data_ptr<float>(), L_ > 0 ? t.data_ptr<float>() : nullptr, embed_[3].data_ptr<float>(),
                   embed_[4].data_ptr<float>(), h.data_ptr<float>(), M, D_, eps_);
    clock.lap(NORMS);
    torch::Tensor y = project(h, N, act);
    clock.lap(PROJECT);
    return y;
  }

  // seconds spent in each phase over every forward so far: embed, norms, matmuls (with the GELU), attention, project
  std::vector<double> phase_seconds() {
    const std::lock_guard<std::mutex> held(seconds_lock_);
    return seconds_;
  }

 private:
  const float* norm(int64_t l, int i) const { return norms_[4 * l + i].data_ptr<float>(); }

  // x (M, D) = im2col(pixels) W^T + b + pos
  void embed(const torch::Tensor& px, torch::Tensor& x, Act8& act) {
    const int64_t N = px.size(0), K = 3 * p_ * p_;
    torch::Tensor cols = torch::empty({N * P_, K}, px.options());
    const float* src = px.data_ptr<float>();
    float* dst = cols.data_ptr<float>();
    at::parallel_for(0, N * side_, 1, [&](int64_t b, int64_t e) {
      for (int64_t ni = b; ni < e; ++ni) {
        const int64_t n = ni / side_, i = ni % side_;
        for (int64_t j = 0; j < side_; ++j) {
          float* row = dst + ((n * side_ + i) * side_ + j) * K;
          for (int64_t c = 0; c < 3; ++c)
            for (int64_t ky = 0; ky < p_; ++ky) {
              const float* s = src + ((n * 3 + c) * S_ + i * p_ + ky) * S_ + j * p_;
              std::copy(s, s + p_, row + (c * p_ + ky) * p_);
            }
        }
      }
    });
    linear(cols, patch_, x, act);
    const float* pos = embed_[2].data_ptr<float>();
    float* xd = x.data_ptr<float>();
    at::parallel_for(0, N * P_, 64, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        for (int64_t d = 0; d < D_; ++d) xd[r * D_ + d] += pos[(r % P_) * D_ + d];
    });
  }

  // out (M, D) = softmax(q k^T / sqrt(hd)) v per tile and head, q k v read in place from qkv (M, 3D)
  void attention(const torch::Tensor& qkv, int64_t N, torch::Tensor& out) {
    const torch::Tensor v5 = qkv.view({N, P_, 3, H_, D_ / H_});
    const torch::Tensor q = v5.select(2, 0).transpose(1, 2), k = v5.select(2, 1).transpose(1, 2),
                        v = v5.select(2, 2).transpose(1, 2);  // (N, H, P, hd)
    const torch::Tensor o = at::scaled_dot_product_attention(q, k, v);  // (N, H, P, hd)
    out.view({N, P_, H_, D_ / H_}).copy_(o.transpose(1, 2));
  }

  // the projector: (M, D) hidden states -> (N * tokens, T)
  torch::Tensor project(const torch::Tensor& x, int64_t N, Act8& act) {
    const int64_t g = side_ / s_, tok = g * g, K = proj_.k;
    torch::Tensor in = torch::empty({N * tok, K}, x.options());
    const float* xs = x.data_ptr<float>();
    float* d = in.data_ptr<float>();
    at::parallel_for(0, N * tok, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int64_t n = r / tok, i = r % tok / g, j = r % g;  // token (i, j) of tile n
        float* row = d + r * K;
        if (kind_ == 1) std::fill(row, row + D_, 0.f);
        for (int64_t a = 0; a < s_; ++a)
          for (int64_t c = 0; c < s_; ++c) {
            const float* patch = xs + (n * P_ + (i * s_ + a) * side_ + j * s_ + c) * D_;
            if (kind_ == 0) {  // pixel shuffle: patch (s i + a, s j + c) at (a s + c) D
              std::copy(patch, patch + D_, row + (a * s_ + c) * D_);
            } else {
              for (int64_t q = 0; q < D_; ++q) row[q] += patch[q];
            }
          }
        if (kind_ == 1) {  // mean, then y = x / sqrt(mean(x^2) + eps) * w
          const float inv = 1.f / static_cast<float>(s_ * s_), *w = embed_[5].data_ptr<float>();
          double sq = 0;
          for (int64_t q = 0; q < D_; ++q) row[q] *= inv, sq += double(row[q]) * row[q];
          const float r_ = static_cast<float>(1.0 / std::sqrt(sq / D_ + eps_));
          for (int64_t q = 0; q < D_; ++q) row[q] = row[q] * r_ * w[q];
        }
      }
    });
    torch::Tensor y = torch::empty({N * tok, T_}, x.options());
    linear(in, proj_, y, act);
    return y;
  }

  int64_t kind_ = 0, S_ = 0, p_ = 0, D_ = 0, F_ = 0, L_ = 0, H_ = 0, T_ = 0, s_ = 1, side_ = 0, P_ = 0;
  double eps_;
  std::vector<double> seconds_ = std::vector<double>(PHASES, 0.0);
  std::mutex seconds_lock_;
  std::vector<torch::Tensor> embed_, norms_;
  std::vector<VMat> mats_;
  VMat proj_, patch_;
};

void bind_vision(pybind11::module_& m) {
  pybind11::class_<VisionTower>(m, "VisionTower")
      .def(pybind11::init<std::vector<int64_t>, double, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<torch::Tensor>, bool>())
      .def("forward", &VisionTower::forward, "pixels (N, 3, S, S) float32 -> (N * tokens, T) float32",
           pybind11::arg("pixels"), pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("tokens_per_tile", &VisionTower::tokens_per_tile)
      .def("amx_matrices", &VisionTower::amx_matrices)
      .def("phase_seconds", &VisionTower::phase_seconds,
           "seconds in each phase over every forward: embed, norms, matmuls (with the GELU), attention, project");
}

}  // namespace wq
