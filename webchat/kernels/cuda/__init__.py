"""CUDA kernels (kernels/cuda/*.cu) launched through CuPy; importing this never needs CuPy or a GPU."""

from __future__ import annotations

from webchat.kernels.cuda.launch import KernelInputError
from webchat.kernels.cuda.loader import KernelUnavailable, kernel_source
from webchat.kernels.cuda.ops import CudaOps

__all__ = ["CudaOps", "KernelInputError", "KernelUnavailable", "kernel_source"]
