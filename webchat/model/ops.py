"""The model's hot ops in plain PyTorch: the CPU path, and the reference every CUDA kernel is tested against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from webchat.model import kv_format
from webchat.model.batch import Batch


class TorchOps:
    """Hot ops with the signatures webchat.kernels.cuda.CudaOps shares (docs/design.md)."""

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
    def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # y = gelu(gate, approximate="tanh") * up (Gemma)
        return F.gelu(gate, approximate="tanh") * up


@dataclass
class _AttnPlan:
    """What paged_attention derives from a batch once and reuses in every layer."""

    decode_rows: torch.Tensor  # (D,) rows that are the only new token of their sequence
    decode_slots: torch.Tensor  # (D, Lmax) cache slots each reads, padded with slot 0
    decode_mask: torch.Tensor | None  # (D, 1, 1, Lmax) True where a slot is real; None when none is padding
    prefill: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (lo, hi, slots (L,), causal mask (t, L))


class PagedTorchOps(TorchOps):
    """The paged-cache ops of a ragged batch (webchat.model.batch.Batch), in plain PyTorch: the reference for
    kernels/cuda/."""

    @staticmethod
    def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # cache (num_pages, page_size, n_kv, row) viewed as (slots, n_kv, row); cache[slot_mapping[i]] = k[i], v[i]
        # as the cache stores a row (webchat.model.kv_format: its dtype, or q8_0's bytes)
        n_kv, row = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, n_kv, row).index_copy_(0, slot_mapping, kv_format.encode(k, k_cache))
        v_cache.view(-1, n_kv, row).index_copy_(0, slot_mapping, kv_format.encode(v, v_cache))

    @staticmethod
    def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch, *,
                        scale: float | None = None, softcap: float = 0.0, window: int = 0) -> torch.Tensor:
        # per sequence b: o = softmax(q k^T / sqrt(hd) + causal by position) v over its pages; q, o (T, H, hd).
        # Single-token sequences go through one padded SDPA call; longer chunks one call each. A score scale, a soft
        # cap or a window that cuts keys: paged_attention_ex.
        if scale is not None or softcap > 0 or (window > 0 and batch.max_seq_len > window):
            hd = q.shape[-1]
            return paged_attention_ex(q, k_cache, v_cache, batch, hd ** -0.5 if scale is None else scale, softcap,
                                      window)
        plan = batch.plan if isinstance(batch.plan, _AttnPlan) else _plan(batch, k_cache.shape[1])
        batch.plan = plan
        n_kv, row, hd = k_cache.shape[2], k_cache.shape[3], q.shape[-1]
        kf, vf = k_cache.view(-1, n_kv, row), v_cache.view(-1, n_kv, row)  # (slots, n_kv, row)

        def read(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # (len(slots), n_kv, hd) in q's dtype
            return kv_format.decode(cache.index_select(0, slots), hd, q.dtype)

        out = torch.empty_like(q)
        if plan.decode_rows.numel():
            d, lmax = plan.decode_slots.shape
            idx = plan.decode_slots.reshape(-1)
            k = read(kf, idx).view(d, lmax, n_kv, hd).transpose(1, 2)  # (D, n_kv, Lmax, hd)
            v = read(vf, idx).view(d, lmax, n_kv, hd).transpose(1, 2)
            # the H / n_kv query heads sharing a kv head are g query rows of one head: (D, n_kv, g, hd)
            qd = q.index_select(0, plan.decode_rows).view(d, n_kv, -1, hd)
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=plan.decode_mask)  # (D, n_kv, g, hd)
            out.index_copy_(0, plan.decode_rows, o.reshape(d, -1, hd))
        for lo, hi, slots, mask in plan.prefill:
            k = read(kf, slots).transpose(0, 1).unsqueeze(0)  # (1, n_kv, L, hd)
            v = read(vf, slots).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask,
                                               enable_gqa=True)
            out[lo:hi] = o.squeeze(0).transpose(0, 1)
        return out


def paged_attention_ex(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch, scale: float,
                       softcap: float, window: int) -> torch.Tensor:
    """Paged attention with a score scale, soft-capping and a sliding window (Gemma), sequence by sequence.

    s = scale * q k^T; s = cap * tanh(s / cap) if cap; row i (position p) sees positions j with p - window < j <= p
    (window 0: all j <= p; j < key_ends[i] in place of j <= p where the batch has key_ends: an image's slots);
    o = softmax(s) v. q, o (T, H, hd); caches (num_pages, page_size, n_kv, hd).
    """
    page_size, n_kv, row, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3], q.shape[-1]
    kf, vf = k_cache.view(-1, n_kv, row), v_cache.view(-1, n_kv, row)  # (slots, n_kv, row)
    g = q.shape[1] // n_kv
    out = torch.empty_like(q)
    starts, lens = batch.query_start.tolist(), batch.seq_lens.tolist()
    offsets = torch.arange(page_size, device=q.device)
    for b, length in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        pages = batch.block_tables[b, : -(-length // page_size)].long()
        slots = (pages.unsqueeze(1) * page_size + offsets).reshape(-1)[:length]  # (L,)
        k = kv_format.decode(kf.index_select(0, slots), hd).repeat_interleave(g, dim=1).transpose(0, 1)  # (H, L, hd)
        v = kv_format.decode(vf.index_select(0, slots), hd).repeat_interleave(g, dim=1).transpose(0, 1)
        s = torch.matmul(q[lo:hi].float().transpose(0, 1), k.transpose(1, 2)) * scale  # (H, t, L)
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        pos, j = batch.positions[lo:hi].unsqueeze(1), torch.arange(length, device=q.device).unsqueeze(0)
        ends = pos + 1 if batch.key_ends is None else batch.key_ends[lo:hi].unsqueeze(1)  # an image's slots: theirs
        seen = (j < ends) & (j > pos - window) if window > 0 else j < ends  # (t, L)
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
        out[lo:hi] = torch.matmul(p, v).transpose(0, 1).to(q.dtype)  # (t, H, hd)
    return out


def _plan(batch: Batch, page_size: int) -> _AttnPlan:
    dev = batch.tokens.device
    starts, lens = batch.query_start.tolist(), batch.seq_lens.tolist()
    offsets = torch.arange(page_size, device=dev)
    dec_rows: list[int] = []
    dec_slots: list[torch.Tensor] = []
    prefill = []
    for b, length in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        pages = batch.block_tables[b, : -(-length // page_size)].long()
        slots = (pages.unsqueeze(1) * page_size + offsets).reshape(-1)[:length]  # (L,) slots of positions 0..L-1
        if hi - lo == 1:
            dec_rows.append(lo)
            dec_slots.append(slots)
        else:  # causal, or each row up to its key end (an image's slots see each other both ways)
            ends = batch.positions[lo:hi] + 1 if batch.key_ends is None else batch.key_ends[lo:hi]
            prefill.append((lo, hi, slots, torch.arange(length, device=dev).unsqueeze(0) < ends.unsqueeze(1)))
    lmax = max((len(s) for s in dec_slots), default=0)
    mask = None
    if any(len(s) != lmax for s in dec_slots):
        mask = torch.stack([torch.arange(lmax, device=dev) < len(s) for s in dec_slots]).view(-1, 1, 1, lmax)
    padded = [F.pad(s, (0, lmax - len(s))) for s in dec_slots]
    return _AttnPlan(torch.tensor(dec_rows, dtype=torch.long, device=dev),
                     torch.stack(padded) if padded else torch.zeros((0, 0), dtype=torch.long, device=dev), mask,
                     prefill)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
