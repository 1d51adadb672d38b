"""CUDA kernels (gpu/*.cu) launched through CuPy; importing this never needs CuPy or a GPU."""

from __future__ import annotations

from webchat.gpu.loader import KernelUnavailable, kernel_source
from webchat.gpu.ops import CudaOps, KernelInputError

__all__ = ["CudaOps", "KernelInputError", "KernelUnavailable", "kernel_source"]
