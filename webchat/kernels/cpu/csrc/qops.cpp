// Dequantization, the batched forward's owner (class Step) and the Python bindings (docs/quant.md).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "qcommon.h"
#include "qint8.h"
#include "qstep.h"
#include "qsuffix.h"
#include "vision.h"

namespace wq {

inline void check_weight(const torch::Tensor& w, int64_t qtype, int64_t k) {
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(bb > 0, "qtype must be 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1) or 8 (Q8_0), got ", qtype);
  TORCH_CHECK(k > 0 && k % 32 == 0, "K must be a positive multiple of 32 (the block size), got ", k);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.device().is_cpu() && w.is_contiguous(),
              "w must be a contiguous 2-D uint8 CPU tensor, got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(w.size(1) == k / 32 * bb, "w rows must hold ", k / 32 * bb, " bytes for K=", k, ", got ", w.size(1));
}

// y (M, N) = x (M, K) @ dequant(w (N, row_bytes))^T [+ bias]: the row kernels, or (gemm) the prompt rows' GEMM,
// or (int8) x's rows quantized to 8 bits and the int8 kernels (qint8.h); x2: each row as two 8-bit rows, the value
// and what its rounding leaves (the int8x2 precision), y the sum of their products; amx: the GEMM on AMX tiles where
// the kernels take them (qgemm_amx.cpp: a flagged exact row's GEMM in the forward), else its FMA tiles
torch::Tensor qmatmul(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t k,
                      const c10::optional<torch::Tensor>& bias, bool gemm, bool int8, bool packed, bool x2,
                      bool amx) {
  if (is_kquant(qtype)) {  // the C++ forward's K-quant rows (kq_rows), the op its tests call
    const int64_t bb = kq_block_bytes(static_cast<int>(qtype));
    TORCH_CHECK(k > 0 && k % 256 == 0, "K must be a positive multiple of 256 for Q4_K/Q5_K/Q6_K, got ", k);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.device().is_cpu() && w.is_contiguous() &&
                    w.size(1) == k / 256 * bb,
                "a Q4_K/Q5_K/Q6_K matrix must be contiguous uint8 (n, ", k / 256 * bb, ") on the CPU, got ",
                w.sizes());
  } else {
    check_weight(w, qtype, k);
  }
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be (M, ", k, "), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu(), "x must be float32 on the CPU, got ",
              x.scalar_type(), " on ", x.device());
  const torch::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), n = w.size(0);
  torch::Tensor y = torch::empty({m, n}, xc.options());
  if (m == 0 || n == 0) return y;
  TORCH_CHECK(!packed || ((int8 || gemm) && packs8(static_cast<int>(qtype), n)), "packed rows are read by the int8 ",
              "kernels and the GEMM, of Q4_0, Q4_1 and Q4_K matrices with rows a multiple of 8 (got int8=", int8,
              ", gemm=", gemm, ", ggml type ", qtype, ", ", n, " rows)");
  TORCH_CHECK(!x2 || int8, "x2 (two 8-bit terms a row) needs int8");
  if (int8 && x2) {  // each row's pair (Act8::quantize_pair) through the kernels, y = y_hi + y_lo
    const int qt = static_cast<int>(qtype);
    Act8 a;
    a.shape(2 * m, k, reads_blocks(qt), reads_supers(qt));
    const float* xp = xc.data_ptr<float>();
    at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) a.quantize_pair(2 * r, xp + r * k);
    });
    torch::Tensor two = torch::empty({2 * m, n}, xc.options());
    const MatRef r{w.data_ptr<uint8_t>(), n, w.size(1), qt, two.data_ptr<float>(), packed};
    qmatmul8_multi(a, 0, 2 * m, nullptr, &r, 1, gemm);
    torch::Tensor pairs = two.view({m, 2, n});
    y.copy_(pairs.select(1, 0) + pairs.select(1, 1));
  } else if (int8) {
    const int qt = static_cast<int>(qtype);
    Act8 a;
    a.shape(m, k, reads_blocks(qt), reads_supers(qt));
    a.quantize_rows(xc.data_ptr<float>(), k);
    const MatRef r{w.data_ptr<uint8_t>(), n, w.size(1), qt, y.data_ptr<float>(), packed};
    qmatmul8_multi(a, 0, m, xc.data_ptr<float>(), &r, 1, gemm);
  } else if (gemm) {
    const MatRef r{w.data_ptr<uint8_t>(), n, w.size(1), static_cast<int>(qtype), y.data_ptr<float>(), packed};
    qgemm_multi(xc.data_ptr<float>(), m, k, &r, 1, amx);
  } else {
    torch::Tensor xsum2 = torch::empty({m, k / 32, 2}, xc.options());
    qmatmul_raw(xc.data_ptr<float>(), m, k, w.data_ptr<uint8_t>(), n, w.size(1), static_cast<int>(qtype),
                xsum2.data_ptr<float>(), y.data_ptr<float>());
  }
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// w's rows packed 8 to a group or back, in place (qpack8.cpp)
void repack8_op(torch::Tensor& w, int64_t qtype, bool pack) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.device().is_cpu() && w.is_contiguous(),
              "w must be a contiguous 2-D uint8 CPU tensor, got ", w.scalar_type(), " ", w.sizes());
  repack8(w.data_ptr<uint8_t>(), w.size(0), w.size(1), static_cast<int>(qtype), pack);
}

// ids as a contiguous 1-D int64 tensor, each in [0, rows): the rows a lookup reads
static torch::Tensor checked_ids(const torch::Tensor& ids, int64_t rows) {
  torch::Tensor idx = ids.to(torch::kInt64).contiguous();
  TORCH_CHECK(idx.dim() == 1, "ids must be 1-D, got ", idx.sizes());
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.size(0); ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "id ", ip[i], " is out of range [0, ", rows, ")");
  return idx;
}

// (len(ids), row bytes) uint8: rows ids of a matrix packed 8 to a group, in the file's layout (a tied head's rows read
// as the embedding's)
torch::Tensor unpacked_rows(const torch::Tensor& w, int64_t qtype, const torch::Tensor& ids) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.device().is_cpu() && w.is_contiguous(),
              "w must be a contiguous 2-D uint8 CPU tensor, got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(packs8(static_cast<int>(qtype), w.size(0)), "ggml type ", qtype, " with ", w.size(0),
              " rows has no packed form");
  const torch::Tensor idx = checked_ids(ids, w.size(0));
  const int64_t n = idx.size(0), rb = w.size(1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  torch::Tensor out = torch::empty({n, rb}, torch::dtype(torch::kUInt8));
  for (int64_t i = 0; i < n; ++i)
    packed_row(static_cast<int>(qtype), w.data_ptr<uint8_t>(), rb, ip[i], out.data_ptr<uint8_t>() + i * rb);
  return out;
}

// (len(ids), K) float32 rows ids of w; ids None: every row (the whole matrix)
torch::Tensor dequantize(const torch::Tensor& w, int64_t qtype, int64_t k, const c10::optional<torch::Tensor>& ids) {
  check_weight(w, qtype, k);
  const torch::Tensor idx = ids.has_value() ? checked_ids(*ids, w.size(0)) : torch::Tensor();
  const int64_t n = ids.has_value() ? idx.size(0) : w.size(0);
  const int64_t* ip = ids.has_value() ? idx.data_ptr<int64_t>() : nullptr;
  torch::Tensor out = torch::empty({n, k}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int qt = static_cast<int>(qtype);
  at::parallel_for(0, n, 64, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) dequant_row(qt, wp + (ip ? ip[i] : i) * w.size(1), k, op + i * k);
  });
  return out;
}

static void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu() && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

// the sampler's scans (qsample.cpp) over rows of x (N, V): the greedy token of every row, row r with values[r] added
// at ids[r] first (a request's token bias, each sum in float32 as torch's index_add_ makes it; none where ids is
// empty), its logits as they were once it is picked ...
std::vector<int64_t> argmax_rows(const torch::Tensor& x, const std::vector<std::vector<int64_t>>& ids,
                                 const std::vector<std::vector<float>>& values) {
  check_f32(x, "logits");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "logits must be (rows, vocab), got ", x.sizes());
  const int64_t v = x.size(1);
  TORCH_CHECK(ids.size() == values.size() && (ids.empty() || static_cast<int64_t>(ids.size()) == x.size(0)),
              "bias ids and values need one list per row (or none), got ", ids.size(), " and ", values.size(),
              " for ", x.size(0), " rows");
  std::vector<int64_t> out(x.size(0));
  std::vector<float> kept;
  for (int64_t r = 0; r < x.size(0); ++r) {
    float* row = x.data_ptr<float>() + r * v;
    const std::vector<int64_t>* at = ids.empty() ? nullptr : &ids[r];
    if (at != nullptr) {
      TORCH_CHECK(at->size() == values[r].size(), "row ", r, ": ", at->size(), " bias ids but ", values[r].size(),
                  " values");
      kept.resize(at->size());
      for (size_t i = 0; i < at->size(); ++i) {
        const int64_t t = (*at)[i];
        TORCH_CHECK(t >= 0 && t < v, "bias id ", t, " is outside the vocabulary of ", v);
      }
      for (size_t i = 0; i < at->size(); ++i) kept[i] = row[(*at)[i]], row[(*at)[i]] += values[r][i];
    }
    out[r] = argmax_row(row, v);
    if (at != nullptr)
      for (size_t i = at->size(); i-- > 0;) row[(*at)[i]] = kept[i];  // backwards: a repeated id ends as it began
  }
  return out;
}

// ... and, for rows[i] and its token tokens[i]: (probability, rank, [(id, probability)] of its ks[i] alternatives)
std::vector<std::tuple<double, int64_t, std::vector<std::pair<int64_t, double>>>> describe_rows(
    const torch::Tensor& x, const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
    const std::vector<int64_t>& ks) {
  check_f32(x, "logits");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "logits must be (rows, vocab), got ", x.sizes());
  TORCH_CHECK(rows.size() == tokens.size() && rows.size() == ks.size(), "rows, tokens and ks must be as long");
  const int64_t v = x.size(1);
  std::vector<std::tuple<double, int64_t, std::vector<std::pair<int64_t, double>>>> out;
  std::vector<int64_t> ids;
  std::vector<float> probs;
  for (size_t i = 0; i < rows.size(); ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < x.size(0), "row ", rows[i], " is outside the ", x.size(0), " logits rows");
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < v, "token ", tokens[i], " is outside the vocabulary of ", v);
    TORCH_CHECK(ks[i] >= 0 && ks[i] <= v, "cannot list ", ks[i], " alternatives of ", v);
    ids.resize(ks[i]), probs.resize(ks[i]);
    float prob;
    int64_t rank;
    describe_row(x.data_ptr<float>() + rows[i] * v, v, tokens[i], static_cast<int>(ks[i]), &prob, &rank, ids.data(),
                 probs.data());
    std::vector<std::pair<int64_t, double>> top(ks[i]);
    for (int64_t j = 0; j < ks[i]; ++j) top[j] = {ids[j], probs[j]};
    out.emplace_back(prob, rank, std::move(top));
  }
  return out;
}

int64_t set_path(int64_t p) {
  TORCH_CHECK(p >= -1 && p <= PATH_AVX512, "path must be -1 (best), 0 (scalar), 1 (avx2) or 2 (avx512), got ", p);
  TORCH_CHECK(p <= best_path(), "path ", p, " needs instructions this CPU lacks (best here: ", best_path(), ")");
  g_path = p < 0 ? best_path() : static_cast<int>(p);
  return g_path;
}

// The batched forward (qstep.cpp) with the tensors it points into kept alive here.
class Step {
 public:
  // dims: dim, n_heads, n_kv, head_dim, ffn; per layer norms (attn, ffn), mats (wq wk wv wo w1 w3 w2) with their
  // qtypes (0: float32 (n, k)), biases (q, k, v; an empty tensor for none), qk_norms (q, k per head: Qwen3, Gemma 3;
  // empty for none), post_norms (attention, MLP output: Gemma; empty for none), windows (per layer, 0: none; empty:
  // none anywhere), local (per layer 1 where the local rope tables apply), scalars (embed scale, attention scale
  // (0: 1 / sqrt(head_dim)), attention soft cap (0: none), 1 for gelu_tanh instead of silu)
  Step(std::vector<int64_t> dims, double eps, torch::Tensor emb, int64_t emb_qtype, torch::Tensor head,
       int64_t head_qtype, torch::Tensor final_norm, std::vector<torch::Tensor> norms, std::vector<torch::Tensor> mats,
       std::vector<int64_t> qtypes, std::vector<torch::Tensor> biases, std::vector<torch::Tensor> qk_norms,
       std::vector<torch::Tensor> post_norms, std::vector<int64_t> windows, std::vector<int64_t> local,
       std::vector<double> scalars) {
    TORCH_CHECK(dims.size() == 5, "dims must be (dim, n_heads, n_kv, head_dim, ffn), got ", dims.size(), " values");
    m_.dim = dims[0], m_.n_heads = dims[1], m_.n_kv = dims[2], m_.head_dim = dims[3], m_.ffn = dims[4];
    TORCH_CHECK(m_.n_kv > 0 && m_.n_heads % m_.n_kv == 0 && m_.n_heads / m_.n_kv <= 64 && m_.head_dim % 2 == 0,
                "heads must be a multiple (at most 64x) of kv heads and head_dim even, got ", m_.n_heads, ", ",
                m_.n_kv, ", ", m_.head_dim);
    m_.eps = static_cast<float>(eps);
    const size_t n_layers = norms.size() / 2;
    TORCH_CHECK(norms.size() == 2 * n_layers && mats.size() == 7 * n_layers && qtypes.size() == mats.size() &&
                    biases.size() == 3 * n_layers,
                "per layer: 2 norms, 7 matrices with 7 qtypes, 3 biases; got ", norms.size(), ", ", mats.size(), ", ",
                qtypes.size(), ", ", biases.size());
    TORCH_CHECK(qk_norms.empty() || qk_norms.size() == 2 * n_layers, "qk_norms: 2 per layer or none, got ",
                qk_norms.size());
    TORCH_CHECK(post_norms.empty() || post_norms.size() == 2 * n_layers, "post_norms: 2 per layer or none, got ",
                post_norms.size());
    TORCH_CHECK((windows.empty() || windows.size() == n_layers) && (local.empty() || local.size() == n_layers),
                "windows and local: one per layer or none, got ", windows.size(), " and ", local.size());
    TORCH_CHECK(scalars.size() == 4, "scalars must be (embed scale, attention scale, soft cap, gelu), got ",
                scalars.size(), " values");
    m_.embed_scale = static_cast<float>(scalars[0]), m_.attn_scale = static_cast<float>(scalars[1]);
    m_.attn_softcap = static_cast<float>(scalars[2]), m_.gelu = scalars[3] != 0.0;
    m_.emb = mat(emb, emb_qtype, m_.dim, torch::Tensor());
    m_.head = mat(head, head_qtype, m_.dim, torch::Tensor());
    m_.final_norm = vec(final_norm, m_.dim);
    const int64_t qd = m_.n_heads * m_.head_dim, kvd = m_.n_kv * m_.head_dim;
    const int64_t ks[7] = {m_.dim, m_.dim, m_.dim, qd, m_.dim, m_.dim, m_.ffn};
    const int64_t ns[7] = {qd, kvd, kvd, m_.dim, m_.ffn, m_.ffn, m_.dim};
    for (size_t i = 0; i < n_layers; ++i) {
      Layer L;
      L.attn_norm = vec(norms[2 * i], m_.dim);
      L.ffn_norm = vec(norms[2 * i + 1], m_.dim);
      if (!qk_norms.empty()) {
        L.q_norm = vec(qk_norms[2 * i], m_.head_dim);
        L.k_norm = vec(qk_norms[2 * i + 1], m_.head_dim);
      }
      if (!post_norms.empty()) {
        L.attn_post_norm = vec(post_norms[2 * i], m_.dim);
        L.ffn_post_norm = vec(post_norms[2 * i + 1], m_.dim);
      }
      L.window = windows.empty() ? 0 : windows[i];
      L.local_rope = !local.empty() && local[i] != 0;
      TORCH_CHECK(L.window >= 0, "layer ", i, " has a negative window");
      Mat* slots[7] = {&L.wq, &L.wk, &L.wv, &L.wo, &L.w1, &L.w3, &L.w2};
      for (int j = 0; j < 7; ++j) {
        *slots[j] = mat(mats[7 * i + j], qtypes[7 * i + j], ks[j], j < 3 ? biases[3 * i + j] : torch::Tensor());
        TORCH_CHECK(slots[j]->n == ns[j], "layer ", i, " matrix ", j, " has ", slots[j]->n, " rows, expected ", ns[j]);
      }
      m_.layers.push_back(L);
    }
  }

  // int8 activations on or off; with them, the matrices that have a packed form read it (the caller packs their bytes
  // in place first, webchat.model.precision; a head that is the embedding packs with it: the lookup gathers its rows)
  void set_int8(bool on, bool pack) { set_precision(on ? INT8 : EXACT, on ? INT8 : EXACT, pack); }

  // the precision (Prec: 0 exact, 1 int8, 2 int8x2) of decode, verify and recomputed rows and that of a prompt's rows;
  // where either quantizes, the matrices that have a packed form read it (pack), as set_int8
  void set_precision(int64_t rows, int64_t prompt, bool pack) {
    TORCH_CHECK(rows >= EXACT && rows <= INT8X2 && prompt >= EXACT && prompt <= INT8X2,
                "precisions are 0 (exact), 1 (int8) or 2 (int8x2), got ", rows, " and ", prompt);
    TORCH_CHECK(!(rows == EXACT && prompt != EXACT), "a prompt's rows quantize only where the other rows do (their ",
                "matrices are packed for them), got exact rows and prompt precision ", prompt);
    m_.prec = static_cast<Prec>(rows), m_.prompt_prec = static_cast<Prec>(prompt);
    const bool on = rows != EXACT;
    pack = pack && on;
    for (Layer& L : m_.layers)
      for (Mat* mt : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w1, &L.w3, &L.w2}) mt->packed = pack && packs8(mt->qtype, mt->n);
    m_.head.packed = pack && packs8(m_.head.qtype, m_.head.n);
    m_.emb.packed = m_.head.packed && m_.head.w == m_.emb.w;
  }

  // logits (R, vocab) of a webchat.model.batch.Batch through the first n_layers layers, k/v written into the pool;
  // prompt_ends (B) int64, or empty: rows of b at positions below prompt_ends[b] are prompt rows (qgemm.cpp); exact
  // (B) bool, or empty: b's rows and logit rows at float32 activations whatever the precision (a prompt scored)
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& positions, const torch::Tensor& slots,
                        const torch::Tensor& query_start, const torch::Tensor& block_tables,
                        const torch::Tensor& logit_rows, const torch::Tensor& prompt_ends,
                        const std::vector<torch::Tensor>& k,
                        const std::vector<torch::Tensor>& v, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& cos_l, const torch::Tensor& sin_l, int64_t n_layers,
                        const torch::Tensor& exact) {
    const int64_t T = tokens.numel();
    for (const torch::Tensor* t : {&tokens, &positions, &slots, &logit_rows})
      TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->dim() == 1 && t->is_contiguous() && t->device().is_cpu(),
                  "tokens, positions, slot_mapping and logit_rows must be contiguous 1-D int64 CPU tensors");
    TORCH_CHECK(T > 0 && positions.numel() == T && slots.numel() == T, "tokens, positions and slot_mapping must hold ",
                "the same number (>0) of rows, got ", T, ", ", positions.numel(), ", ", slots.numel());
    for (const torch::Tensor* t : {&query_start, &block_tables})
      TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous() && t->device().is_cpu(),
                  "query_start and block_tables must be contiguous int32 CPU tensors");
    TORCH_CHECK(block_tables.dim() == 2 && query_start.dim() == 1 && query_start.numel() == block_tables.size(0) + 1,
                "block_tables must be (B, width) and query_start (B + 1), got ", block_tables.sizes(), " and ",
                query_start.sizes());
    BatchView bv;
    bv.tokens = tokens.data_ptr<int64_t>(), bv.positions = positions.data_ptr<int64_t>();
    bv.slots = slots.data_ptr<int64_t>(), bv.t = T;
    bv.query_start = query_start.data_ptr<int32_t>(), bv.b = block_tables.size(0);
    bv.block_tables = block_tables.data_ptr<int32_t>(), bv.width = block_tables.size(1);
    bv.logit_rows = logit_rows.data_ptr<int64_t>(), bv.r = logit_rows.numel();
    if (prompt_ends.numel() > 0) {
      TORCH_CHECK(prompt_ends.scalar_type() == torch::kInt64 && prompt_ends.dim() == 1 && prompt_ends.is_contiguous() &&
                      prompt_ends.device().is_cpu() && prompt_ends.numel() == bv.b,
                  "prompt_ends must be a contiguous 1-D int64 CPU tensor of ", bv.b, " values (or empty), got ",
                  prompt_ends.scalar_type(), " ", prompt_ends.sizes());
      bv.prompt_ends = prompt_ends.data_ptr<int64_t>();
    }
    if (exact.numel() > 0) {
      TORCH_CHECK((exact.scalar_type() == torch::kBool || exact.scalar_type() == torch::kUInt8) && exact.dim() == 1 &&
                      exact.is_contiguous() && exact.device().is_cpu() && exact.numel() == bv.b,
                  "exact must be a contiguous 1-D bool CPU tensor of ", bv.b, " values (or empty), got ",
                  exact.scalar_type(), " ", exact.sizes());
      bv.exact = reinterpret_cast<const uint8_t*>(exact.data_ptr());
    }
    return run(bv, k, v, cos, sin, cos_l, sin_l, n_layers);
  }

  // the same forward from a batch's host lists (webchat.model.batch.HostRows) as pybind hands them over: no tensor
  // is made for them; block_tables is (B * width) page ids, row by row
  torch::Tensor forward_rows(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                             const std::vector<int64_t>& slots, const std::vector<int32_t>& query_start,
                             const std::vector<int32_t>& block_tables, int64_t width,
                             const std::vector<int64_t>& logit_rows, const std::vector<int64_t>& prompt_ends,
                             const std::vector<torch::Tensor>& k, const std::vector<torch::Tensor>& v,
                             const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& cos_l,
                             const torch::Tensor& sin_l, int64_t n_layers, const std::vector<int64_t>& embed_rows,
                             const torch::Tensor& embeds, const std::vector<int64_t>& key_ends,
                             const std::vector<bool>& exact) {
    const int64_t T = static_cast<int64_t>(tokens.size()), B = static_cast<int64_t>(query_start.size()) - 1;
    TORCH_CHECK(T > 0 && positions.size() == tokens.size() && slots.size() == tokens.size(), "tokens, positions and ",
                "slot_mapping must hold the same number (>0) of rows, got ", T, ", ", positions.size(), ", ",
                slots.size());
    TORCH_CHECK(B >= 1 && width >= 1 && static_cast<int64_t>(block_tables.size()) == B * width,
                "block_tables must hold (B = ", B, ") x width (", width, ") pages, got ", block_tables.size());
    TORCH_CHECK(prompt_ends.empty() || static_cast<int64_t>(prompt_ends.size()) == B, "prompt_ends must hold ", B,
                " values (or none), got ", prompt_ends.size());
    BatchView bv;
    bv.tokens = tokens.data(), bv.positions = positions.data(), bv.slots = slots.data(), bv.t = T;
    bv.query_start = query_start.data(), bv.b = B, bv.block_tables = block_tables.data(), bv.width = width;
    bv.logit_rows = logit_rows.data(), bv.r = static_cast<int64_t>(logit_rows.size());
    bv.prompt_ends = prompt_ends.empty() ? nullptr : prompt_ends.data();
    check_images(bv, embed_rows, embeds, key_ends);
    TORCH_CHECK(exact.empty() || static_cast<int64_t>(exact.size()) == B, "exact must hold ", B,
                " values (or none), got ", exact.size());
    std::vector<uint8_t> flags(exact.begin(), exact.end());
    bv.exact = flags.empty() ? nullptr : flags.data();
    return run(bv, k, v, cos, sin, cos_l, sin_l, n_layers);
  }

 private:
  StepModel m_;
  std::vector<torch::Tensor> keep_;

  torch::Tensor run(const BatchView& bv, const std::vector<torch::Tensor>& k, const std::vector<torch::Tensor>& v,
                    const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& cos_l,
                    const torch::Tensor& sin_l, int64_t n_layers) {
    TORCH_CHECK(n_layers >= 1 && n_layers <= static_cast<int64_t>(m_.layers.size()), "n_layers must be in [1, ",
                m_.layers.size(), "], got ", n_layers);
    TORCH_CHECK(static_cast<int64_t>(k.size()) >= n_layers && v.size() == k.size(), "the pool has ", k.size(),
                " layers, the forward needs ", n_layers);
    const int64_t num_pages = k[0].size(0), ps = k[0].dim() == 4 ? k[0].size(1) : 0;
    // the pool's format from its dtype (webchat.model.kv_format): float32, float16, or uint8 rows of q8_0 blocks
    const auto dt = k[0].scalar_type();
    TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kFloat16 || dt == torch::kUInt8,
                "a KV pool must be float32, float16 or uint8 (q8_0 blocks), got ", dt);
    const KVKind kind = dt == torch::kFloat32 ? KV_F32 : dt == torch::kFloat16 ? KV_F16 : KV_Q8_0;
    TORCH_CHECK(kind != KV_Q8_0 || m_.head_dim % 32 == 0, "a q8_0 KV pool needs heads of whole 32-value blocks, not ",
                m_.head_dim);
    const int64_t row = kind == KV_Q8_0 ? m_.head_dim / 32 * 34 : m_.head_dim;
    // a row's values contiguous, a page's slots one stride apart and the pages after one another (any order of the
    // dims in memory with those: a CPU pool stores each head's slots together), every tensor alike
    const auto strides = k[0].strides();
    std::vector<uint8_t*> kp, vp;
    for (int64_t i = 0; i < n_layers; ++i) {
      for (const torch::Tensor* t : {&k[i], &v[i]}) {
        TORCH_CHECK(t->scalar_type() == dt && t->device().is_cpu(),
                    "KV pool tensors must be CPU tensors of one dtype (", dt, "), got ", t->scalar_type());
        TORCH_CHECK(t->dim() == 4 && t->size(0) == num_pages && t->size(1) == ps && t->size(2) == m_.n_kv &&
                        t->size(3) == row,
                    "KV pool tensors must be (", num_pages, ", ", ps, ", ", m_.n_kv, ", ", row, "), got ",
                    t->sizes());
        TORCH_CHECK(t->strides() == strides && strides[3] == 1 && strides[0] == ps * strides[1],
                    "KV pool tensors must hold a row's values together and a page's slots one stride apart, each "
                    "like the first; got strides ", t->strides(), " and ", strides);
      }
      kp.push_back(static_cast<uint8_t*>(k[i].data_ptr()));
      vp.push_back(static_cast<uint8_t*>(v[i].data_ptr()));
    }
    check_f32(cos, "cos");
    check_f32(sin, "sin");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) * 2 == m_.head_dim && sin.sizes() == cos.sizes(),
                "cos/sin must be (positions, ", m_.head_dim / 2, "), got ", cos.sizes(), " and ", sin.sizes());
    const bool local = cos_l.numel() > 0;
    if (local) {
      check_f32(cos_l, "cos_l");
      check_f32(sin_l, "sin_l");
      TORCH_CHECK(cos_l.sizes() == cos.sizes() && sin_l.sizes() == cos.sizes(), "the local rope tables must be ",
                  cos.sizes(), ", got ", cos_l.sizes(), " and ", sin_l.sizes());
    }
    check_batch(bv, num_pages, ps, cos.size(0));
    torch::Tensor logits = torch::empty({bv.r, m_.head.n}, torch::dtype(torch::kFloat32));
    const int64_t esize = static_cast<int64_t>(k[0].element_size());
    PoolView pv{kp.data(), vp.data(), ps, kind, strides[1] * esize, strides[2] * esize};
    {
      py::gil_scoped_release nogil;
      m_.forward(bv, pv, cos.data_ptr<float>(), sin.data_ptr<float>(), local ? cos_l.data_ptr<float>() : nullptr,
                 local ? sin_l.data_ptr<float>() : nullptr, n_layers, logits.data_ptr<float>());
    }
    return logits;
  }

  // an image's rows (BatchView.embed_rows, embeds, key_ends): each given row inside the batch and dim wide, each row's
  // keys its own position's and at most its sequence's last row's in this batch (those k/v are written before attention)
  void check_images(BatchView& bv, const std::vector<int64_t>& rows, const torch::Tensor& embeds,
                    const std::vector<int64_t>& key_ends) const {
    if (!rows.empty()) {
      check_f32(embeds, "embeds");
      TORCH_CHECK(embeds.dim() == 2 && embeds.size(0) == static_cast<int64_t>(rows.size()) && embeds.size(1) == m_.dim,
                  "embeds must be (", rows.size(), ", ", m_.dim, "), one row per embed row, got ", embeds.sizes());
      for (int64_t r : rows) TORCH_CHECK(r >= 0 && r < bv.t, "embed row ", r, " is outside the batch's ", bv.t, " rows");
      bv.embed_rows = rows.data(), bv.embeds = embeds.data_ptr<float>(), bv.e = static_cast<int64_t>(rows.size());
    }
    if (key_ends.empty()) return;
    TORCH_CHECK(static_cast<int64_t>(key_ends.size()) == bv.t, "key_ends must hold one value per row (", bv.t,
                "), got ", key_ends.size());
    for (int64_t b = 0; b < bv.b; ++b) {
      const int64_t last = bv.positions[bv.query_start[b + 1] - 1] + 1;
      for (int64_t t = bv.query_start[b]; t < bv.query_start[b + 1]; ++t)
        TORCH_CHECK(key_ends[t] > bv.positions[t] && key_ends[t] <= last, "key_ends[", t, "] = ", key_ends[t],
                    " must be in [", bv.positions[t] + 1, ", ", last, "]: past the row, within its sequence's batch");
    }
    bv.key_ends = key_ends.data();
  }

  // every index the forward follows stays inside its tensor: a bad batch is an error, never a wild write
  void check_batch(const BatchView& bv, int64_t num_pages, int64_t ps, int64_t rope_rows) const {
    TORCH_CHECK(bv.query_start[0] == 0 && bv.query_start[bv.b] == bv.t, "query_start must run from 0 to ", bv.t);
    for (int64_t b = 0; b < bv.b; ++b) {
      TORCH_CHECK(bv.query_start[b] < bv.query_start[b + 1] && bv.query_start[b + 1] <= bv.t, "sequence ", b,
                  " has no rows, or rows past ", bv.t, ", in query_start");
      for (int64_t j = 0; j < bv.width; ++j) {
        const int32_t page = bv.block_tables[b * bv.width + j];
        TORCH_CHECK(page >= 0 && page < num_pages, "block table page ", page, " is outside the pool of ", num_pages);
      }
      for (int64_t t = bv.query_start[b]; t < bv.query_start[b + 1]; ++t)
        TORCH_CHECK(bv.positions[t] >= 0 && bv.positions[t] < rope_rows && bv.positions[t] / ps < bv.width,
                    "position ", bv.positions[t], " of row ", t, " is outside its block table or the rope table");
    }
    for (int64_t t = 0; t < bv.t; ++t) {
      TORCH_CHECK(bv.tokens[t] >= 0 && bv.tokens[t] < m_.emb.n, "token ", bv.tokens[t], " is out of range [0, ",
                  m_.emb.n, ")");
      TORCH_CHECK(bv.slots[t] >= 0 && bv.slots[t] < num_pages * ps, "slot ", bv.slots[t], " is outside the pool");
    }
    for (int64_t r = 0; r < bv.r; ++r)
      TORCH_CHECK(bv.logit_rows[r] >= 0 && bv.logit_rows[r] < bv.t, "logit row ", bv.logit_rows[r], " out of range");
  }

  Mat mat(const torch::Tensor& w, int64_t qtype, int64_t k, const torch::Tensor& bias) {
    Mat m;
    if (qtype == F32) {
      check_f32(w, "a float matrix");
      TORCH_CHECK(w.dim() == 2 && w.size(1) == k, "a float matrix must be (n, ", k, "), got ", w.sizes());
      m.w = reinterpret_cast<const uint8_t*>(w.data_ptr<float>()), m.row_bytes = k * 4;
    } else if (is_kquant(qtype)) {  // Q4_K / Q5_K / Q6_K from GGUF files (qkquant.cpp)
      const int64_t bb = kq_block_bytes(static_cast<int>(qtype));
      TORCH_CHECK(k % 256 == 0, "a Q4_K/Q5_K/Q6_K matrix needs K a multiple of 256, got ", k);
      TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(1) == k / 256 * bb,
                  "a Q4_K/Q5_K/Q6_K matrix must be contiguous uint8 (n, ", k / 256 * bb, "), got ", w.sizes());
      m.w = w.data_ptr<uint8_t>(), m.row_bytes = w.size(1);
    } else {
      check_weight(w, qtype, k);
      m.w = w.data_ptr<uint8_t>(), m.row_bytes = w.size(1);
    }
    keep_.push_back(w);
    m.n = w.size(0), m.k = k, m.qtype = static_cast<int>(qtype);
    if (bias.defined() && bias.numel() > 0) m.bias = vec(bias, m.n);
    return m;
  }

  const float* vec(const torch::Tensor& t, int64_t n) {
    check_f32(t, "vector");
    TORCH_CHECK(t.numel() == n, "expected ", n, " values, got ", t.numel());
    keep_.push_back(t);
    return t.data_ptr<float>();
  }
};

}  // namespace wq

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &wq::qmatmul,
        "y = x @ dequant(w).T (+ bias), float32; gemm: as the forward computes prompt rows; int8: x's rows at 8 bits",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("k"), py::arg("bias") = py::none(),
        py::arg("gemm") = false, py::arg("int8") = false, py::arg("packed") = false, py::arg("x2") = false,
        py::arg("amx") = false);
  m.def("repack8", &wq::repack8_op,
        "w's rows packed 8 to a group for the int8 kernels (pack) or back to ggml's layout, in place (Q4_0, Q4_1, Q8_0, "
        "Q4_K)",
        py::arg("w"), py::arg("qtype"), py::arg("pack"));
  m.def("unpacked_rows", &wq::unpacked_rows, "rows ids of a packed matrix in the file's layout (uint8)",
        py::arg("w"), py::arg("qtype"), py::arg("ids"));
  m.def("packs8", &wq::packs8, "whether a matrix of this ggml type and row count has the packed form",
        py::arg("qtype"), py::arg("n"));
  m.def("set_vnni", &wq::set_vnni,
        "the int8 kernels' vpdpbusd: -1 where the CPU has it, 0 off, 1 on (AVX-512 VNNI's forms where the CPU has "
        "them, else AVX-VNNI's), 2 AVX-VNNI's forms; returns in use");
  m.def("vnni", &wq::vnni, "whether the int8 kernels use vpdpbusd");
  m.def("set_amx", &wq::set_amx,
        "the exact prompt GEMM's AMX-BF16 tiles (AVX-512 path): -1 where the CPU and the OS allow them, 0 off, 1 on; "
        "returns on");
  m.def("amx", &wq::amx, "whether the exact prompt GEMM takes AMX tiles (on the AVX-512 path)");
  m.def("dequantize", &wq::dequantize, "float32 rows of a quantized matrix", py::arg("w"), py::arg("qtype"),
        py::arg("k"), py::arg("ids") = py::none());
  m.def("set_path", &wq::set_path, "force a code path (-1 best, 0 scalar, 1 avx2, 2 avx512); returns the one set");
  m.def("path", &wq::path);
  m.def("argmax_rows", &wq::argmax_rows, "the first largest logit's index of each row, a row's token bias added",
        py::arg("x"), py::arg("ids") = std::vector<std::vector<int64_t>>(),
        py::arg("values") = std::vector<std::vector<float>>());
  m.def("describe_rows", &wq::describe_rows, "(prob, rank, top alternatives) of tokens[i] in row rows[i]",
        py::arg("x"), py::arg("rows"), py::arg("tokens"), py::arg("ks"));
  m.def("best_path", &wq::best_path);
  py::class_<wq::Step>(m, "Step")
      .def(py::init<std::vector<int64_t>, double, torch::Tensor, int64_t, torch::Tensor, int64_t, torch::Tensor,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<int64_t>,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<double>>())
      .def("set_int8", &wq::Step::set_int8,
           "int8 activations for the quantized matrices (False: float32); pack: the packed rows where a type has them",
           py::arg("on"), py::arg("pack") = true)
      .def("set_precision", &wq::Step::set_precision,
           "the precision of decode/verify rows and of a prompt's rows: 0 exact, 1 int8, 2 int8x2 (two 8-bit terms)",
           py::arg("rows"), py::arg("prompt"), py::arg("pack") = true)
      .def("forward", &wq::Step::forward)
      .def("forward_rows", &wq::Step::forward_rows);
  wq::bind_suffix(m);
  wq::bind_vision(m);
}
