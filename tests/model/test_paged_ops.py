"""The paged-cache reference ops agree with attention over contiguous k/v: scattered pages, ragged rows, GQA,
chunked rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from webchat.model.batch import make_batch
from webchat.model.ops import PagedTorchOps


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + causal) v for q (T, H, hd) at positions start.., k/v (n_kv, start+T, hd)."""
    t, end = q.shape[0], start + q.shape[0]
    mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                       attn_mask=mask if t > 1 else None, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def test_paged_attention_matches_contiguous_per_sequence() -> None:
    gen = torch.Generator().manual_seed(0)
    page_size, n_pages, n_kv, heads, hd = 4, 32, 2, 6, 8
    k_cache = torch.zeros(n_pages, page_size, n_kv, hd)
    v_cache = torch.zeros_like(k_cache)
    # (cached length, new tokens, pages in scrambled order); sequence 2 is a 5-token prefill chunk after 7 cached
    shapes = [(0, 1, [5]), (9, 1, [3, 17, 8]), (7, 5, [30, 2, 11]), (0, 6, [21, 4])]
    seqs, contiguous = [], []
    for cached, new, pages in shapes:
        total = cached + new
        k_all = torch.randn(total, n_kv, hd, generator=gen)
        v_all = torch.randn(total, n_kv, hd, generator=gen)
        if cached:  # the earlier tokens are already in the pages
            old = make_batch([(list(range(cached)), 0, pages, [-1])], page_size)
            PagedTorchOps.kv_write(k_cache, v_cache, k_all[:cached], v_all[:cached], old.slot_mapping)
        seqs.append((list(range(new)), cached, pages, [-1]))
        contiguous.append((cached, k_all, v_all))
    batch = make_batch(seqs, page_size)
    q = torch.randn(batch.tokens.shape[0], heads, hd, generator=gen)
    new_k = torch.cat([k[c:] for c, k, _ in contiguous])
    new_v = torch.cat([v[c:] for c, _, v in contiguous])
    PagedTorchOps.kv_write(k_cache, v_cache, new_k, new_v, batch.slot_mapping)
    out = PagedTorchOps.paged_attention(q, k_cache, v_cache, batch)
    starts = batch.query_start.tolist()
    for b, (cached, k_all, v_all) in enumerate(contiguous):
        lo, hi = starts[b], starts[b + 1]
        ref = contiguous_attention(q[lo:hi], k_all.transpose(0, 1), v_all.transpose(0, 1), cached)
        torch.testing.assert_close(out[lo:hi], ref, rtol=0, atol=1e-5)
