// The sampler's scans of a logits row (webchat.engine.sampling, its CPU batch path): the greedy pick, and what the
// heatmap shows of a token (its probability under softmax of the raw logits, its rank, the top alternatives). The
// same numbers as sampling._describe_rows' torch ops, in three passes over the row on the calling thread instead of
// ~10 torch ops each spread over the OpenMP team: on the default model's 49,152 logits, ~0.4 ms a token -> ~0.03 ms.
// softmax: p_i = exp(x_i - max) / sum_j exp(x_j - max), the sum and each reported probability in double. rank: 1 + #{i : x_i > x_t} on the raw logits (log_softmax is monotonic).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "qcommon.h"

namespace wq {

#define AVX2_FN __attribute__((target("avx2,fma")))

static float max_scalar(const float* x, int64_t n) {
  float r = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

// (sum_i exp(x_i - mx), #{i : x_i > xt}); the sum in double, so 49,152 terms lose nothing to their order
AVX2_FN static void exp_sum_count_avx2(const float* x, int64_t n, float mx, float xt, double* sum, int64_t* above) {
  const __m256 vm = _mm256_set1_ps(mx), vt = _mm256_set1_ps(xt);
  __m256d acc = _mm256_setzero_pd();
  int64_t count = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i), e = exp256(_mm256_sub_ps(v, vm));
    acc = _mm256_add_pd(acc, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)),
                                           _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1))));
    count += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(v, vt, _CMP_GT_OQ))));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, acc);
  double s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) s += std::exp(x[i] - mx), count += x[i] > xt;
  *sum = s, *above = count;
}

static void exp_sum_count_scalar(const float* x, int64_t n, float mx, float xt, double* sum, int64_t* above) {
  double s = 0.;
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(x[i] - mx), count += x[i] > xt;
  *sum = s, *above = count;
}

// the k largest of x (k <= n) into vals/ids, descending, ties to the lower id: each x_i above the k-th kept value
// goes in by insertion; on AVX2 eight at a time are first compared with that value, so most of the row is one compare
struct TopK {
  float* vals;
  int64_t* ids;
  int k, have = 0;
  void offer(float v, int64_t id) {
    if (have == k && !(v > vals[k - 1])) return;
    int p = have < k ? have++ : k - 1;
    for (; p > 0 && vals[p - 1] < v; --p) vals[p] = vals[p - 1], ids[p] = ids[p - 1];
    vals[p] = v, ids[p] = id;
  }
  float floor() const { return have < k ? -std::numeric_limits<float>::infinity() : vals[k - 1]; }
};

AVX2_FN static void top_k_avx2(const float* x, int64_t n, TopK& top) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    if (top.have == top.k && !_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(top.floor()), _CMP_GT_OQ))) continue;
    for (int l = 0; l < 8; ++l) top.offer(x[i + l], i + l);
  }
  for (; i < n; ++i) top.offer(x[i], i);
}

AVX2_FN static int64_t first_equal_avx2(const float* x, int64_t n, float v) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(v), _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < n; ++i)
    if (x[i] == v) return i;
  return -1;
}

int64_t argmax_row(const float* x, int64_t n) {
  int64_t at = -1;
  if (path() >= PATH_AVX2) {
    at = first_equal_avx2(x, n, max_avx2(x, n));
  } else {
    const float mx = max_scalar(x, n);
    for (int64_t i = 0; i < n && at < 0; ++i) at = x[i] == mx ? i : -1;
  }
  return at < 0 ? 0 : at;  // -1: every logit NaN
}

void describe_row(const float* x, int64_t n, int64_t t, int k, float* prob, int64_t* rank, int64_t* top_ids,
                  float* top_probs) {
  const bool vec = path() >= PATH_AVX2;
  const float mx = vec ? max_avx2(x, n) : max_scalar(x, n);
  double sum;
  int64_t above;
  (vec ? exp_sum_count_avx2 : exp_sum_count_scalar)(x, n, mx, x[t], &sum, &above);
  const double log_sum = std::log(sum);
  auto p = [&](float v) { return static_cast<float>(std::exp(double(v - mx) - log_sum)); };
  *prob = p(x[t]), *rank = above + 1;
  if (k <= 0) return;
  TopK top{top_probs, top_ids, k};  // the logits first, then each turned into its probability in place
  if (vec) {
    top_k_avx2(x, n, top);
  } else {
    for (int64_t i = 0; i < n; ++i) top.offer(x[i], i);
  }
  for (int j = 0; j < k; ++j) top_probs[j] = p(top_probs[j]);
}

}  // namespace wq
