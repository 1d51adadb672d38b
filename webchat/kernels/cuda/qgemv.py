"""The dequantizing GEMV of kernels/cuda/qgemv.cu: y (M, N) = x (M, K) @ dequant(w (N, row_bytes)).T for ggml's Q4_0,
Q4_1 and Q8_0 blocks (docs/quant.md), float accumulation, x and y float16/bfloat16/float32. Meant for decode (small
M)."""

from __future__ import annotations

import numpy as np
import torch

from webchat.kernels.cuda.launch import KernelInputError, Launch, Launcher, check, check_device, ptr, suffix

BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
WARPS = 4  # qgemv.cu QGEMV_WARPS: output rows per block of 128 threads


def plan_qgemv(x: torch.Tensor, w: torch.Tensor, qtype: str) -> Launch:
    """Check x (M, K) contiguous and w (N, K/32 * block bytes) uint8 contiguous; one warp per output row."""
    if qtype not in BLOCK_BYTES:
        raise KernelInputError(f"qtype must be one of {', '.join(BLOCK_BYTES)}, got {qtype!r}")
    sfx = suffix("x", x)
    if x.dim() != 2 or x.shape[1] % 32:
        raise KernelInputError(f"x must be (M, K) with K a multiple of 32, got shape {tuple(x.shape)}")
    check("x", x, tuple(x.shape))
    check("w", w, (None, x.shape[1] // 32 * BLOCK_BYTES[qtype]), torch.uint8)
    return Launch("qgemv", f"qgemv_{qtype}_{sfx}", (-(-w.shape[0] // WARPS), 1, 1), (32 * WARPS, 1, 1))


def qgemv(
    launch: Launcher, x: torch.Tensor, w: torch.Tensor, qtype: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y (M, N) in x's dtype, on x's device; launch is CudaOps' launcher (CuPy, or the emulator on CPU tensors)."""
    plan = plan_qgemv(x, w, qtype)
    m, n = x.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    check("out", y, (m, n), x.dtype)
    check_device(x.device, w=w, out=y)
    if m and n:
        launch(plan, (ptr(x), ptr(w), ptr(y), np.int32(m), np.int32(n), np.int32(x.shape[1]), np.int64(w.shape[1])))
    return y
