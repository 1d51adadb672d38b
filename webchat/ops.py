"""The model's hot ops in plain PyTorch: the CPU path, and the reference every CUDA kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from webchat.batch import Batch


class TorchOps:
    """Hot ops with the signatures webchat.gpu.CudaOps shares (docs/design.md)."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        # y = x * w / sqrt(mean(x*x) + eps), computed in float32 as Hugging Face does
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * y.to(x.dtype)

    @staticmethod
    def add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # residual' = x + residual; y = rms_norm(residual')
        residual = residual + x
        return TorchOps.rms_norm(residual, w, eps), residual

    @staticmethod
    def rope(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q (T, n_heads, hd), k (T, n_kv, hd), cos/sin (T, hd/2); rotate_half pairs (i, i + hd/2):
        # out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(q.dtype)  # (T, 1, hd)
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # y = silu(gate) * up
        return F.silu(gate) * up

    @staticmethod
    def kv_append(
        cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> None:
        # cache (n_kv, capacity, hd) ← k, v (T, n_kv, hd) at positions start..start+T-1
        t = k.shape[0]
        cache_k[:, start : start + t] = k.transpose(0, 1)
        cache_v[:, start : start + t] = v.transpose(0, 1)

    @staticmethod
    def attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, start: int) -> torch.Tensor:
        # o = softmax(q k^T / sqrt(hd) + causal) v over cache[:, :start+T]; q (T, H, hd) → o (T, H, hd)
        t = q.shape[0]
        end = start + t
        k = cache_k[:, :end].unsqueeze(0)  # (1, n_kv, L, hd)
        v = cache_v[:, :end].unsqueeze(0)
        mask = None
        if t > 1:
            rows = torch.arange(start, end, device=q.device).unsqueeze(1)
            mask = torch.arange(end, device=q.device).unsqueeze(0) <= rows  # (T, L)
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)  # (T, H, hd)


class PagedTorchOps(TorchOps):
    """The paged-cache ops of a ragged batch (webchat.batch.Batch), in plain PyTorch: the reference for gpu/."""

    @staticmethod
    def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # cache (num_pages, page_size, n_kv, hd) viewed as (slots, n_kv, hd); cache[slot_mapping[i]] = k[i], v[i]
        n_kv, hd = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, n_kv, hd).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, n_kv, hd).index_copy_(0, slot_mapping, v)

    @staticmethod
    def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch) -> torch.Tensor:
        # per sequence b: o = softmax(q k^T / sqrt(hd) + causal by position) v over its pages; q, o (T, H, hd)
        page_size, n_kv, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        out = torch.empty_like(q)
        starts = batch.query_start.tolist()
        lens = batch.seq_lens.tolist()
        for b, length in enumerate(lens):
            lo, hi = starts[b], starts[b + 1]
            n_pages = -(-length // page_size)
            pages = batch.block_tables[b, :n_pages].long()
            k = k_cache.index_select(0, pages).reshape(-1, n_kv, hd)[:length]  # (L, n_kv, hd)
            v = v_cache.index_select(0, pages).reshape(-1, n_kv, hd)[:length]
            pos = batch.positions[lo:hi]
            mask = torch.arange(length, device=q.device).unsqueeze(0) <= pos.unsqueeze(1)  # (t, L)
            o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                               v.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True)
            out[lo:hi] = o.squeeze(0).transpose(0, 1)
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
