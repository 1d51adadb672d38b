"""CudaOps: the model's hot ops as CUDA kernels launched through CuPy on torch's current stream (no copies).

Each op validates its tensors in a pure `plan_*` function (dtype, shape, contiguity; runnable on any device) that also
computes the launch geometry, then hands raw pointers to the kernel. Signatures match webchat.model.ops.PagedTorchOps;
what every op shares (Launch, the launcher, the checks) is in webchat.kernels.cuda.launch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from webchat.kernels.cuda import loader
from webchat.kernels.cuda.launch import (
    ELEMENTWISE_THREADS,
    KernelArg,
    KernelInputError,
    Launch,
    Launcher,
    blocks,
    check,
    check_device,
    i32,
    ptr,
    suffix,
    warp_round,
)
from webchat.model.batch import Batch

# ---- plans: validate and compute the launch (pure; any device) ----


def plan_rms_norm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> Launch:
    sfx = suffix("x", x)
    if x.dim() != 2:
        raise KernelInputError(f"x must have shape (T, dim), got {tuple(x.shape)}")
    check("x", x, (None, None))
    if x.shape[1] == 0:
        raise KernelInputError("x must have at least one column, got shape (T, 0)")
    check("w", w, (x.shape[1],), x.dtype)
    if residual is not None:
        check("residual", residual, tuple(x.shape), x.dtype)
    entry = f"{'add_' if residual is not None else ''}rms_norm_{sfx}"
    return Launch("rms_norm", entry, (max(1, x.shape[0]), 1, 1), (warp_round(x.shape[1], 256), 1, 1))


def plan_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Launch:
    sfx = suffix("q", q)
    if q.dim() != 3 or q.shape[2] % 2:
        raise KernelInputError(f"q must have shape (T, n_heads, head_dim) with head_dim even, got {tuple(q.shape)}")
    t, n_heads, hd = q.shape
    check("q", q, (t, n_heads, hd))
    check("k", k, (t, None, hd), q.dtype)
    check("cos", cos, (t, hd // 2), torch.float32)
    check("sin", sin, (t, hd // 2), torch.float32)
    pairs = t * (n_heads + k.shape[1]) * (hd // 2)
    return Launch("rope", f"rope_{sfx}", (blocks(pairs, ELEMENTWISE_THREADS), 1, 1), (ELEMENTWISE_THREADS, 1, 1))


def plan_silu_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> Launch:
    """silu_mul.cu's silu_mul_* or (act "gelu_tanh") gelu_tanh_mul_* over gate's values."""
    sfx = suffix("gate", gate)
    check("gate", gate, tuple(gate.shape))
    check("up", up, tuple(gate.shape), gate.dtype)
    grid = (blocks(gate.numel(), ELEMENTWISE_THREADS), 1, 1)
    return Launch("silu_mul", f"{act}_mul_{sfx}", grid, (ELEMENTWISE_THREADS, 1, 1))


class CudaOps:
    """Hot ops with TorchOps' signatures (docs/design.md) on one CUDA device; outputs are fresh tensors except rope,
    which rotates q and k in place and returns them."""

    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda", launcher: Launcher | None = None, n_sm: int = 0) -> None:
        self.device = torch.device(device)
        if launcher is None:
            self.device, n_sm, launcher = _shared_launcher(self.device)
        self._launch = launcher
        self.n_sm = n_sm or 132

    def rms_norm(
        self, x: torch.Tensor, w: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        # y = x * w / sqrt(mean(x*x) + eps)
        launch = plan_rms_norm(x, w)
        y = _output("out", out, x)
        check_device(self.device, x=x, w=w, out=y)
        if x.shape[0]:  # the grid is one block per row
            self._launch(launch, (ptr(x), ptr(w), ptr(y), i32(x.shape[1]), np.float32(eps)))
        return y

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        w: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # residual' = x + residual; y = rms_norm(residual')
        launch = plan_rms_norm(x, w, residual)
        y, res_out = _output("out", out, x), _output("residual_out", residual_out, x)
        check_device(self.device, x=x, residual=residual, w=w, out=y, residual_out=res_out)
        args = (ptr(x), ptr(residual), ptr(w), ptr(y), ptr(res_out), i32(x.shape[1]), np.float32(eps))
        if x.shape[0]:
            self._launch(launch, args)
        return y, res_out

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # in place: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (pairs i, i + hd/2)
        launch = plan_rope(q, k, cos, sin)
        check_device(self.device, q=q, k=k, cos=cos, sin=sin)
        t, n_heads, hd = q.shape
        self._launch(launch, (ptr(q), ptr(k), ptr(cos), ptr(sin), i32(t), i32(n_heads), i32(k.shape[1]), i32(hd)))
        return q, k

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        # y = silu(gate) * up
        return self._gated(plan_silu_mul(gate, up), gate, up, out)

    def gelu_tanh_mul(self, gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        # y = gelu(gate, approximate="tanh") * up (Gemma)
        return self._gated(plan_silu_mul(gate, up, "gelu_tanh"), gate, up, out)

    def _gated(self, launch: Launch, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        y = _output("out", out, gate)
        check_device(self.device, gate=gate, up=up, out=y)
        self._launch(launch, (ptr(gate), ptr(up), ptr(y), np.int64(gate.numel())))
        return y

    # ---- paged KV cache over a ragged batch (webchat.model.batch.Batch); plans in kernels/cuda/paged.py ----

    def kv_write(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        # cache (num_pages, page_size, n_kv, hd) viewed as (slots, n_kv, hd); cache[slot_mapping[i]] = k[i], v[i]
        from webchat.kernels.cuda.paged import plan_kv_write

        launch = plan_kv_write(k_cache, v_cache, k, v, slot_mapping)
        check_device(self.device, k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping)
        if k.shape[0] == 0:
            return
        pages, page_size, n_kv, hd = k_cache.shape
        args = (ptr(k_cache), ptr(v_cache), ptr(k), ptr(v), ptr(slot_mapping), i32(k.shape[0]), i32(n_kv), i32(hd),
                np.int64(pages * page_size))  # fmt: skip
        self._launch(launch, args)

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch, *,
        scale: float | None = None, softcap: float = 0.0, window: int = 0, out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        # per sequence b: o = softmax(cap(scale q k^T) + causal by position, within the window) v over its pages;
        # q, o (T, H, hd); scale 1/sqrt(hd) by default, cap(s) = softcap tanh(s / softcap) where softcap > 0
        from webchat.kernels.cuda.paged import plan_paged_attention

        plan = plan_paged_attention(q, k_cache, v_cache, batch, self.n_sm)
        o = _output("out", out, q)
        check_device(self.device, q=q, k_cache=k_cache, v_cache=v_cache, out=o, positions=batch.positions,
                     query_start=batch.query_start, seq_lens=batch.seq_lens, block_tables=batch.block_tables)
        t, n_heads, hd = q.shape
        page_size, n_kv = k_cache.shape[1], k_cache.shape[2]
        part_acc = torch.empty((t, n_heads, plan.n_splits, hd), device=q.device, dtype=torch.float32)
        part_ml = torch.empty((t, n_heads, plan.n_splits, 2), device=q.device, dtype=torch.float32)
        args = (ptr(q), ptr(k_cache), ptr(v_cache), ptr(batch.positions), ptr(batch.query_start), ptr(batch.seq_lens),
                ptr(batch.block_tables), i32(batch.num_seqs), i32(batch.block_tables.shape[1]), i32(page_size),
                i32(n_heads), i32(n_kv), i32(hd), np.float32(1.0 / math.sqrt(hd) if scale is None else scale),
                np.float32(softcap), i32(window), ptr(part_acc), ptr(part_ml))  # fmt: skip
        self._launch(plan.split, args)
        self._launch(plan.reduce, (ptr(part_acc), ptr(part_ml), ptr(o), i32(plan.n_splits), i32(hd)))
        return o


def _output(name: str, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A fresh tensor like `like`, or the caller's `out` after checking it matches."""
    if out is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    check(name, out, tuple(like.shape), like.dtype)
    return out


def cupy_launcher(device: torch.device | str) -> Launcher:
    """The CuPy launcher for a CUDA device (CudaOps, CudaSampler); KernelUnavailable where CuPy or CUDA is missing."""
    return _shared_launcher(torch.device(device))[2]


_launchers: dict[int, tuple[torch.device, int, Launcher]] = {}


def _shared_launcher(device: torch.device) -> tuple[torch.device, int, Launcher]:
    """(device with its index, SM count, launcher), made once per device."""
    cupy = loader.cupy_module()
    if device.type != "cuda" or not torch.cuda.is_available():
        raise loader.KernelUnavailable(f"the CUDA kernels need a CUDA device, got {device} (torch sees CUDA: "
                                       f"{torch.cuda.is_available()})")  # fmt: skip
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _launchers:
        _launchers[index] = _cupy_launcher(cupy, index)
    return _launchers[index]


def _cupy_launcher(cupy: Any, index: int) -> tuple[torch.device, int, Launcher]:
    """The real launcher: CuPy kernels on torch.cuda.current_stream(device), resolved once per entry."""
    device = torch.device("cuda", index)
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    kernels: dict[str, Any] = {}
    streams: dict[int, Any] = {}

    def launch(plan: Launch, args: Sequence[KernelArg]) -> None:
        fn = kernels.get(plan.entry)
        if fn is None:
            with cupy.cuda.Device(index):
                fn = kernels[plan.entry] = loader.function(plan.module, plan.entry)
        handle = torch.cuda.current_stream(device).cuda_stream
        stream = streams.get(handle)
        if stream is None:
            stream = streams[handle] = cupy.cuda.ExternalStream(handle, index)
        fn(plan.grid, plan.block, tuple(args), stream=stream)

    return device, n_sm, launch
