// The model's forward over a ragged batch on the paged KV cache, in C++: raw pointers into tensors that the
// Python-side wrapper (qops.cpp, class Step) keeps alive. Same contract as webchat.model.transformer.Transformer.forward.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <utility>
#include <vector>

#include "qint8.h"

namespace wq {

struct Mat {  // an (n, k) matrix: n rows of row_bytes, ggml type qtype (F32: float rows); bias (n) or nullptr
  const uint8_t* w = nullptr;
  int64_t n = 0, k = 0, row_bytes = 0;
  int qtype = 0;
  const float* bias = nullptr;
  bool packed = false;  // rows packed 8 to a group (qpack8.cpp): with int8 activations, where the type has the form
};

struct Layer {
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* q_norm = nullptr;  // (head_dim): RMS norm of each q head before rope (Qwen3), or none
  const float* k_norm = nullptr;  // (head_dim): the same for each k head
  const float* attn_post_norm = nullptr;  // (dim): Gemma's norm of the attention output before the residual, or none
  const float* ffn_post_norm = nullptr;   // (dim): the same for the MLP's output
  int64_t window = 0;                     // sliding window: a row at position p sees (p - window, p]; 0: all of [0, p]
  bool local_rope = false;                // Gemma 3's sliding layers: the local rope tables
  Mat wq, wk, wv, wo, w1, w3, w2;
};

// webchat.model.batch.Batch: T new tokens of B sequences, flattened
struct BatchView {
  const int64_t* tokens = nullptr;     // (T)
  const int64_t* positions = nullptr;  // (T) position of each token in its sequence
  const int64_t* slots = nullptr;      // (T) page * page_size + offset its k/v go to
  int64_t t = 0;
  const int32_t* query_start = nullptr;  // (B + 1)
  int64_t b = 0;
  const int32_t* block_tables = nullptr;  // (B, width) page ids
  int64_t width = 0;
  const int64_t* logit_rows = nullptr;  // (R)
  int64_t r = 0;
  const int64_t* prompt_ends = nullptr;  // (B) or none: b's rows at positions below it are its prompt's (a GEMM's)
  const uint8_t* exact = nullptr;        // (B) or none: b's prompt rows (and their logit rows) run exact whatever the
                                         // precision (a prompt scored)
  // an image's slots (webchat.engine.images): rows embed_rows[i] take embeds[i] (dim floats) in place of their token's
  // embedding, after the embedding scale (Gemma scales text only); key_ends (T) or none: row t attends positions below
  // key_ends[t] (an image's slots see each other both ways, Gemma 3) instead of positions[t] + 1
  const int64_t* embed_rows = nullptr;  // (E)
  const float* embeds = nullptr;        // (E, dim)
  int64_t e = 0;
  const int64_t* key_ends = nullptr;
};

// How a row's matrix inputs are multiplied (docs/quant.md, "Precisions"): float32 (EXACT); quantized to 8 bits once
// (INT8); or at 8 bits twice, the value and what its rounding leaves, both rows through the int8 kernels and their
// products added (INT8X2: about 15 bits, qint8.h Act8::quantize_pair)
enum Prec { EXACT = 0, INT8 = 1, INT8X2 = 2 };

// How the pool stores a head's row of k or v (webchat.model.kv_format): float32, float16, or ggml's q8_0 blocks (per
// 32 values a float16 scale and 32 int8: 34 bytes)
enum KVKind { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 2 };

// webchat.model.kv_cache.KVPool: per layer k and v pages (num_pages, page_size, n_kv, row), a row a head's hd values
// in `kind`; slot s of head h at s * slot_bytes + h * head_bytes (a CPU pool keeps each head's slots together:
// slot_bytes is one row's, head_bytes the whole layer's slots)
struct PoolView {
  uint8_t* const* k = nullptr;
  uint8_t* const* v = nullptr;
  int64_t page_size = 0;
  KVKind kind = KV_F32;
  int64_t slot_bytes = 0, head_bytes = 0;
};

struct StepModel {
  int64_t dim = 0, n_heads = 0, n_kv = 0, head_dim = 0, ffn = 0;
  float eps = 0.f;
  float embed_scale = 1.f;   // Gemma: the embedding times sqrt(dim)
  float attn_scale = 0.f;    // the score scale; 0: 1 / sqrt(head_dim)
  float attn_softcap = 0.f;  // Gemma 2: scores = cap * tanh(scores / cap); 0: none
  bool gelu = false;         // Gemma: gelu_tanh(w1 y) * w3 y instead of silu
  Prec prec = EXACT;         // decode, verify and recomputed rows, and their logit rows
  Prec prompt_prec = EXACT;  // a prompt's rows (BatchView.prompt_ends) and its logit rows
  Mat emb, head;
  const float* final_norm = nullptr;
  std::vector<Layer> layers;

  // logits (R, vocab) of the batch's logit rows through the first n_layers layers, after writing every token's k/v;
  // cos/sin: rope tables (positions, head_dim/2), cos_l/sin_l those of the local_rope layers (nullptr: the same).
  // Calls are serialised (the scratch buffers are the model's).
  void forward(const BatchView& bv, const PoolView& kv, const float* cos, const float* sin, const float* cos_l,
               const float* sin_l, int64_t n_layers, float* logits);

 private:
  std::mutex mu_;
  std::vector<float> x_, y_, q_, k_, v_, o_, g_, u_, out_, xsum2_, pair_;
  std::vector<float> part_;  // attend's long decode rows: each segment's pass (m, l, hd sums) a query head
  struct Rows {  // a run of rows that one kind of matmul computes
    int64_t lo, hi;
    bool prompt;
    Prec prec;
    int64_t a8;  // its first row in act_ (INT8: a row each, INT8X2: two)
  };
  struct Plan {  // a forward's rows (its token rows, or its logit rows) in runs, and each row's first row in act_
    std::vector<Rows> runs;
    std::vector<int64_t> a8;  // -1 for an exact row
    std::vector<Prec> prec;
    int64_t act_rows = 0;
    void add(int64_t row, bool prompt, Prec p);
  };
  Plan tokens_, logits_;  // this forward's token rows and logit rows
  Act8 act_;              // the next matmul's input rows at 8 bits (the rows of runs that are not exact)
  using Mats = std::initializer_list<std::pair<const Mat*, float*>>;
  void linears(Mats mys, const float* x, const Plan& plan);
  void exact_rows(Mats mys, const float* x, const Rows& run, int64_t k);
  void shape_for(Mats mys, const Plan& plan, int64_t k);                     // act_ for plan's rows of k, mys's forms
  void quantize_row(const Plan& plan, int64_t r, const float* x);            // row r of plan from x (if it has one)
  void quantize_for(Mats mys, const float* x, const Plan& plan, int64_t k);  // shape_for, then every row of x
  void add_biases(Mats mys, int64_t m);
  void attend(const BatchView& bv, const uint8_t* kc, const uint8_t* vc, const PoolView& kv, int64_t window);
};

}  // namespace wq
