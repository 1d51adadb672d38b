// The vision encoder's exact GEMM on AMX (vgemm.cpp): float32 products from bfloat16 pieces.
#pragma once
#include <torch/extension.h>

#include <cstdint>

namespace wq {

// W (n, k) whose every value is the sum of two bfloat16 (F16 and BF16 weights are: 11 significant bits fit in 8 + 8),
// the pieces hi and lo transposed and packed for oneDNN's brgemm in panels of VG_NB columns (the last one zero-padded)
constexpr int64_t VG_NB = 64;
struct SplitMat {
  torch::Tensor hi, lo;  // (panels, k * VG_NB) bfloat16, oneDNN's packed layout
  int64_t n = 0, k = 0;
};

bool amx_bf16();  // torch's oneDNN brgemm packs bfloat16 here and AMX is granted
// w float32 (n, k), k even, with w == bf16(w) + bf16(w - bf16(w)) everywhere: its pieces packed into m (true); false
// (m unchanged) for any other matrix
bool split_pack(const torch::Tensor& w, SplitMat& m);

// y (M, n) = x (M, k) W^T (+ bias): x split likewise, y = xh wh + xh wl + xl wh with float32 accumulation (AMX);
// gelu: y = gelu_tanh(y) as each tile is written
void split_gemm(const float* x, int64_t M, const SplitMat& m, const float* bias, float* y, bool gelu = false);

// x[0, n) = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) on the calling thread: 16 lanes where gelu_wide()
bool gelu_wide();
void gelu_span(float* x, int64_t n);

}  // namespace wq
