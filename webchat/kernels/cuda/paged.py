"""Validation and launch geometry of the paged-cache kernels (kernels/cuda/kv_write.cu, kernels/cuda/paged_attention.cu)
for a ragged batch (webchat.model.batch.Batch); CudaOps.kv_write and CudaOps.paged_attention launch them. Pure: runs on
any device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from webchat.kernels.cuda.launch import (
    ATTENTION_THREADS,
    ELEMENTWISE_THREADS,
    MAX_HEAD_DIM,
    KernelInputError,
    Launch,
    blocks,
    check,
    n_splits,
    suffix,
    warp_round,
)
from webchat.model.batch import Batch


def check_cache(name: str, cache: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[int, int, int, int]:
    """cache (num_pages, page_size, n_kv, head_dim), contiguous; returns its shape."""
    if cache.dim() != 4:
        raise KernelInputError(f"{name} must have shape (num_pages, page_size, n_kv, head_dim), got "
                               f"{tuple(cache.shape)}")  # fmt: skip
    pages, page_size, n_kv, hd = cache.shape
    check(name, cache, (pages, page_size, n_kv, hd), dtype)
    return pages, page_size, n_kv, hd


def plan_kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> Launch:  # fmt: skip
    sfx = suffix("k_cache", k_cache)
    shape = check_cache("k_cache", k_cache)
    check("v_cache", v_cache, shape, k_cache.dtype)
    check("k", k, (None, shape[2], shape[3]), k_cache.dtype)
    check("v", v, tuple(k.shape), k_cache.dtype)
    check("slot_mapping", slot_mapping, (k.shape[0],), torch.int64)
    grid = (blocks(k.numel(), ELEMENTWISE_THREADS), 1, 1)
    return Launch("kv_write", f"kv_write_{sfx}", grid, (ELEMENTWISE_THREADS, 1, 1))


@dataclass(frozen=True)
class PagedAttentionPlan:
    split: Launch
    reduce: Launch
    n_splits: int


def check_batch(batch: Batch, n_tokens: int) -> None:
    """The batch's device tensors have the dtypes and shapes webchat.model.batch.Batch declares, for n_tokens rows."""
    n_seqs = batch.num_seqs
    check("batch.positions", batch.positions, (n_tokens,), torch.int64)
    check("batch.query_start", batch.query_start, (n_seqs + 1,), torch.int32)
    check("batch.seq_lens", batch.seq_lens, (n_seqs,), torch.int32)
    check("batch.block_tables", batch.block_tables, (n_seqs, None), torch.int32)
    if n_seqs < 1 or batch.block_tables.shape[1] < 1:
        raise KernelInputError(f"a batch needs at least one sequence and one page per table, got block_tables of "
                               f"shape {tuple(batch.block_tables.shape)}")  # fmt: skip


def plan_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch,
                         n_sm: int) -> PagedAttentionPlan:  # fmt: skip
    sfx = suffix("q", q)
    if q.dim() != 3:
        raise KernelInputError(f"q must have shape (T, n_heads, head_dim), got {tuple(q.shape)}")
    t, n_heads, hd = q.shape
    check("q", q, (t, n_heads, hd))
    shape = check_cache("k_cache", k_cache, q.dtype)
    check("v_cache", v_cache, shape, q.dtype)
    n_kv, page_size = shape[2], shape[1]
    if shape[3] != hd:
        raise KernelInputError(f"k_cache must have head_dim {hd} like q, got {shape[3]}")
    if t < 1 or n_heads % n_kv:
        raise KernelInputError(f"need T >= 1 and n_heads a multiple of n_kv, got T={t}, {n_heads} and {n_kv}")
    if hd > MAX_HEAD_DIM:
        raise KernelInputError(f"head_dim must be at most {MAX_HEAD_DIM}, got {hd}")
    check_batch(batch, t)
    # the grid comes from host-known bounds only: max_seq_len (or the tables' width); the kernel reads the lengths
    table_keys = batch.block_tables.shape[1] * page_size
    max_keys = min(batch.max_seq_len, table_keys) if batch.max_seq_len > 0 else table_keys
    s = n_splits(max_keys, t * n_heads, n_sm)
    split = Launch("paged_attention", f"paged_attention_split_{sfx}", (s, n_heads, t), (ATTENTION_THREADS, 1, 1))
    reduce = Launch("paged_attention", f"paged_attention_reduce_{sfx}", (t * n_heads, 1, 1),
                    (warp_round(hd, 256), 1, 1))
    return PagedAttentionPlan(split, reduce, s)
