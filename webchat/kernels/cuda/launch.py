"""What every CUDA op shares: the launch record a plan returns, the launcher that runs it (CuPy on a device, the
emulator on the CPU), the error for a bad tensor, the checks that raise it, and the argument packers. Pure: runs on
any device. The plans live beside their ops (webchat.kernels.cuda.ops, .paged, .qgemv, .sampler)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

SUFFIX = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_HEAD_DIM = 256  # paged_attention.cu's largest head
ATTENTION_THREADS = 128  # paged_attention.cu 32 * WARPS
ELEMENTWISE_THREADS = 256
MAX_SPLITS = 128
MIN_KEYS_PER_SPLIT = 16

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


# ---- kernel arguments ----


def ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def i32(v: int) -> np.int32:
    return np.int32(v)
