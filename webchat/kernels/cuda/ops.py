"""CudaOps: the model's hot ops as CUDA kernels launched through CuPy on torch's current stream (no copies).

Each op validates its tensors in a pure `plan_*` function (dtype, shape, contiguity; runnable on any device) that also
computes the launch geometry, then hands raw pointers to the kernel. Signatures match webchat.model.ops.TorchOps, except
that `start` may also be a one-element int32 CUDA tensor, so a captured CUDA graph replays at any position.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from webchat.kernels.cuda import loader
from webchat.model.batch import Batch

SUFFIX = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_HEAD_DIM = 256  # attention.cu MAX_HD
ATTENTION_THREADS = 128  # attention.cu 32 * WARPS
ELEMENTWISE_THREADS = 256
MAX_SPLITS = 128
MIN_KEYS_PER_SPLIT = 16

Start = int | torch.Tensor
KernelArg = np.generic


@dataclass(frozen=True)
class Launch:
    """One kernel launch: module file, extern "C" entry, grid and block (x, y, z)."""

    module: str
    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]


Launcher = Callable[[Launch, Sequence[KernelArg]], None]


class KernelInputError(ValueError):
    """A tensor handed to a CUDA op has the wrong dtype, shape, contiguity or device."""


# ---- validation helpers (pure) ----


def suffix(name: str, t: torch.Tensor) -> str:
    if t.dtype not in SUFFIX:
        raise KernelInputError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    return SUFFIX[t.dtype]


def check(name: str, t: torch.Tensor, shape: Sequence[int | None], dtype: torch.dtype | None = None) -> None:
    """t must be contiguous, of `dtype` (if given) and of `shape` (None matches any size in that dimension)."""
    if dtype is not None and t.dtype != dtype:
        raise KernelInputError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape, strict=True)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise KernelInputError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise KernelInputError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise KernelInputError(f"{name} must be on {device}, got {t.device}")


def blocks(n: int, threads: int) -> int:
    return max(1, (n + threads - 1) // threads)


def warp_round(n: int, cap: int) -> int:
    """Threads per block: n rounded up to a multiple of 32, within [32, cap]."""
    return min(cap, max(32, (n + 31) // 32 * 32))


def n_splits(max_keys: int, rows: int, n_sm: int) -> int:
    """Flash-decoding splits: about 2 blocks per SM over `rows` (T * n_heads), at least 16 keys per split."""
    want = blocks(2 * n_sm, rows)
    return max(1, min(want, blocks(max_keys, MIN_KEYS_PER_SPLIT), MAX_SPLITS))


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


def plan_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> Launch:
    sfx = suffix("gate", gate)
    check("gate", gate, tuple(gate.shape))
    check("up", up, tuple(gate.shape), gate.dtype)
    grid = (blocks(gate.numel(), ELEMENTWISE_THREADS), 1, 1)
    return Launch("silu_mul", f"silu_mul_{sfx}", grid, (ELEMENTWISE_THREADS, 1, 1))


def check_start(start: Start, n_tokens: int, capacity: int) -> None:
    """An int start must keep start..start+T-1 inside the cache; a tensor start is int32 of one element."""
    if isinstance(start, torch.Tensor):
        if start.dtype != torch.int32 or start.numel() != 1:
            raise KernelInputError(
                f"start tensor must be int32 with one element, got {start.dtype} {tuple(start.shape)}"
            )
        return
    if isinstance(start, bool) or not isinstance(start, int):
        raise KernelInputError(f"start must be an int or an int32 tensor, got {type(start).__name__}")
    if start < 0 or start + n_tokens > capacity:
        raise KernelInputError(f"positions {start}..{start + n_tokens - 1} must lie in the cache of {capacity}")


def plan_kv_append(
    cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: Start
) -> Launch:
    sfx = suffix("cache_k", cache_k)
    if cache_k.dim() != 3:
        raise KernelInputError(f"cache_k must have shape (n_kv, capacity, head_dim), got {tuple(cache_k.shape)}")
    n_kv, capacity, hd = cache_k.shape
    check("cache_k", cache_k, (n_kv, capacity, hd))
    check("cache_v", cache_v, (n_kv, capacity, hd), cache_k.dtype)
    check("k", k, (None, n_kv, hd), cache_k.dtype)
    check("v", v, tuple(k.shape), cache_k.dtype)
    check_start(start, k.shape[0], capacity)
    grid = (blocks(k.numel(), ELEMENTWISE_THREADS), 1, 1)
    return Launch("kv_append", f"kv_append_{sfx}", grid, (ELEMENTWISE_THREADS, 1, 1))


@dataclass(frozen=True)
class AttentionPlan:
    split: Launch
    reduce: Launch
    n_splits: int


def plan_attention(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, start: Start, n_sm: int
) -> AttentionPlan:
    sfx = suffix("q", q)
    if q.dim() != 3 or cache_k.dim() != 3:
        raise KernelInputError(
            f"q must be (T, n_heads, head_dim) and cache_k (n_kv, capacity, head_dim), got {tuple(q.shape)} "
            f"and {tuple(cache_k.shape)}"
        )
    t, n_heads, hd = q.shape
    n_kv, capacity = cache_k.shape[0], cache_k.shape[1]
    check("q", q, (t, n_heads, hd))
    check("cache_k", cache_k, (n_kv, capacity, hd), q.dtype)
    check("cache_v", cache_v, (n_kv, capacity, hd), q.dtype)
    if t < 1 or n_heads % n_kv:
        raise KernelInputError(f"need T >= 1 and n_heads a multiple of n_kv, got T={t}, {n_heads} and {n_kv}")
    if hd > MAX_HEAD_DIM:
        raise KernelInputError(f"head_dim must be at most {MAX_HEAD_DIM}, got {hd}")
    check_start(start, t, capacity)
    # a tensor start is unknown on the host (graph replay): size the splits for a full cache
    max_keys = capacity if isinstance(start, torch.Tensor) else start + t
    s = n_splits(max_keys, t * n_heads, n_sm)
    split = Launch("attention", f"attention_split_{sfx}", (s, n_heads, t), (ATTENTION_THREADS, 1, 1))
    reduce = Launch("attention", f"attention_reduce_{sfx}", (t * n_heads, 1, 1), (warp_round(hd, 256), 1, 1))
    return AttentionPlan(split, reduce, s)


# ---- kernel arguments ----


def ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def i32(v: int) -> np.int32:
    return np.int32(v)


def start_args(start: Start) -> tuple[np.uint64, np.int32]:
    """(start_ptr, start_host): the kernel reads *start_ptr when it is non-null."""
    if isinstance(start, torch.Tensor):
        return ptr(start), i32(0)
    return np.uint64(0), i32(start)


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
        launch = plan_silu_mul(gate, up)
        y = _output("out", out, gate)
        check_device(self.device, gate=gate, up=up, out=y)
        self._launch(launch, (ptr(gate), ptr(up), ptr(y), np.int64(gate.numel())))
        return y

    def kv_append(
        self, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: Start
    ) -> None:
        # cache[:, start:start+T] = k.transpose(0, 1)
        launch = plan_kv_append(cache_k, cache_v, k, v, start)
        check_device(self.device, cache_k=cache_k, cache_v=cache_v, k=k, v=v, **_start_tensor(start))
        n_kv, capacity, hd = cache_k.shape
        start_ptr, start_host = start_args(start)
        args = (ptr(cache_k), ptr(cache_v), ptr(k), ptr(v), start_ptr, start_host, i32(k.shape[0]), i32(n_kv), i32(hd),
                i32(capacity))  # fmt: skip
        self._launch(launch, args)

    def attention(
        self,
        q: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        start: Start,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # o = softmax(q k^T / sqrt(hd) + causal) v over cache[:, :start+T]
        plan = plan_attention(q, cache_k, cache_v, start, self.n_sm)
        o = _output("out", out, q)
        check_device(self.device, q=q, cache_k=cache_k, cache_v=cache_v, out=o, **_start_tensor(start))
        t, n_heads, hd = q.shape
        n_kv, capacity = cache_k.shape[0], cache_k.shape[1]
        part_acc = torch.empty((t, n_heads, plan.n_splits, hd), device=q.device, dtype=torch.float32)
        part_ml = torch.empty((t, n_heads, plan.n_splits, 2), device=q.device, dtype=torch.float32)
        start_ptr, start_host = start_args(start)
        args = (ptr(q), ptr(cache_k), ptr(cache_v), start_ptr, start_host, i32(n_heads), i32(n_kv), i32(hd),
                i32(capacity), np.float32(1.0 / math.sqrt(hd)), ptr(part_acc), ptr(part_ml))  # fmt: skip
        self._launch(plan.split, args)
        self._launch(plan.reduce, (ptr(part_acc), ptr(part_ml), ptr(o), i32(plan.n_splits), i32(hd)))
        return o

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
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        # per sequence b: o = softmax(q k^T / sqrt(hd) + causal by position) v over its pages; q, o (T, H, hd)
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
                i32(n_heads), i32(n_kv), i32(hd), np.float32(1.0 / math.sqrt(hd)), ptr(part_acc),
                ptr(part_ml))  # fmt: skip
        self._launch(plan.split, args)
        self._launch(plan.reduce, (ptr(part_acc), ptr(part_ml), ptr(o), i32(plan.n_splits), i32(hd)))
        return o


def _output(name: str, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A fresh tensor like `like`, or the caller's `out` after checking it matches."""
    if out is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    check(name, out, tuple(like.shape), like.dtype)
    return out


def _start_tensor(start: Start) -> dict[str, torch.Tensor]:
    return {"start": start} if isinstance(start, torch.Tensor) else {}


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
