// The decode-step model: raw pointers into tensors that the Python-side wrapper keeps alive (qops.cpp).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

namespace wq {

struct Mat {  // a quantized (n, k) matrix: n rows of row_bytes, ggml type qtype; bias (n) or nullptr
  const uint8_t* w = nullptr;
  int64_t n = 0, k = 0, row_bytes = 0;
  int qtype = 0;
  const float* bias = nullptr;
};

struct Layer {
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  Mat wq, wk, wv, wo, w1, w3, w2;
};

struct StepModel {
  int64_t dim = 0, n_heads = 0, n_kv = 0, head_dim = 0, ffn = 0;
  float eps = 0.f;
  Mat emb, head;
  const float* final_norm = nullptr;
  std::vector<Layer> layers;

  // logits (vocab) for token at pos; cache_k/v[i] (n_kv, cap, hd) of layer i get k, v at pos
  void step(int64_t token, int64_t pos, float* const* cache_k, float* const* cache_v, int64_t cap, const float* cos,
            const float* sin, float* logits);

 private:
  mutable std::vector<float> xsum2_;
  void linear(const Mat& m, const float* x, float* y) const;
  void linears(std::initializer_list<std::pair<const Mat*, float*>> mys, const float* x) const;
  void attend(const float* q, const float* ck, const float* cv, int64_t cap, int64_t len, float* o) const;
  void dequant_row(const Mat& m, int64_t row, float* out) const;
};

}  // namespace wq
