// The attention kernels StepModel::attend (qstep.cpp) runs over a page of the KV pool: a prompt's rows as tiles
// (qattn.cpp: a unit's L query rows, a multiple of 16 with the rest zeros, side by side, lane r a row), and decode and
// verify rows a token at a time (qattn_rows.cpp).
#pragma once
#include <cstdint>

namespace wq {

// asks the cache for n rows of hd floats, st apart (a page's keys or values before its tile)
void prefetch_rows(const float* x, int64_t st, int64_t n, int64_t hd);
// S[i * L + r] = scale * q_r . k_i for the n keys of a page (key i at k + i * st), qt[d * L + r] = q_r,d
void tile_scores(int path, const float* qt, int64_t L, int64_t hd, const float* k, int64_t st, int64_t n, float scale,
                 float* S);
// S (n keys from position key0, L lanes) in place: cap, then the softmax numerators p of each lane's keys [lo_r, hi_r)
// (0 elsewhere); m_r their largest score (-inf where none), l_r = sum p
void tile_softmax(int path, float* S, int64_t L, int64_t n, int64_t key0, const int32_t* lo, const int32_t* hi, float cap,
                  float* m, float* l);
// out[r] (hd floats) += sum_i S[i * L + r] v_i for rows r < rows, over the values of np pages in key order (page q's
// n[q] rows at vp[q], st apart; S's key rows run on across the pages), each lane's sums held in registers throughout
constexpr int VALUE_PAGES = 4;  // pages a call takes: 64 keys of 16-slot pages, a head's 16 KB of values at hd 64
void tile_values(int path, const float* S, int64_t L, int64_t rows, int np, const float* const* vp, const int64_t* n,
                 int64_t st, int64_t hd, float* const* out);

// One token's query rows for `heads` query heads of a kv head (head x's at q + x * hd) against the n keys of a page
// (key i at kp + i * st): s[x][i] = scale * q_x . k_i. Nothing for n <= 0.
void row_scores(int path, const float* q, int64_t heads, int64_t hd, const float* kp, int64_t st, int64_t n,
                float scale, float* const* s);
// o[x] (hd floats) += sum_i w[x][i] v_i over the n values of a page (value i at vp + i * st), in key order
void row_values(int path, float* const* o, const float* const* w, int64_t heads, int64_t hd, const float* vp,
                int64_t st, int64_t n);

}  // namespace wq
