"""Quantized weights behind one seam: QLinear/QEmbedding swapped in before load_state_dict (docs/quant.md).

A quantized weight is a uint8 tensor (out_features, K/32 * block_bytes) holding ggml's blocks row by row, unchanged;
its format (q4_0, q4_1, q8_0) lives on the module. Activations and accumulation stay float32
(webchat.kernels.cpu.build).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# name → (ggml type number, bytes per block of 32 weights)
QTYPES: dict[str, tuple[int, int]] = {"q4_0": (2, 18), "q4_1": (3, 20), "q8_0": (8, 34)}
BLOCK = 32
GEMM_ROWS = 32  # from this many rows of x, QLinear dequantizes the matrix and calls torch's float32 GEMM
GEMM_MAX_WEIGHTS = 4 << 20  # ... if its float32 copy stays under 16 MB (never the 28M-weight head)


def row_bytes(qtype: str, k: int) -> int:
    if qtype not in QTYPES:
        raise ValueError(f"quantized type must be one of {', '.join(QTYPES)}, got {qtype!r}")
    if k % BLOCK:
        raise ValueError(f"{qtype} rows need a multiple of {BLOCK} columns, got {k}")
    return k // BLOCK * QTYPES[qtype][1]


def _uint8_param(rows: int, nbytes: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, nbytes, dtype=torch.uint8), requires_grad=False)


class QLinear(nn.Module):
    """y = x @ dequant(weight).T (+ bias) with weight (out_features, row_bytes) uint8 blocks; x (..., in_features)."""

    def __init__(self, in_features: int, out_features: int, qtype: str, bias: bool, kernels: Any) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.weight = _uint8_param(out_features, row_bytes(qtype, in_features))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2 = x.shape[:-1], x.reshape(-1, self.in_features)
        qt = QTYPES[self.qtype][0]
        if x2.shape[0] >= GEMM_ROWS and self.weight.shape[0] * self.in_features <= GEMM_MAX_WEIGHTS:
            # prefill: dequantize once (float32, exact) and let torch's sgemm do M x N x K; a transient matrix
            y = F.linear(x2, self.kernels.dequantize(self.weight, qt, self.in_features), self.bias)
        else:
            y = self.kernels.qmatmul(x2, self.weight, qt, self.in_features, self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"


class QEmbedding(nn.Module):
    """Rows of a quantized (num_embeddings, row_bytes) table, dequantized to float32 as they are looked up."""

    def __init__(self, num_embeddings: int, dim: int, qtype: str, kernels: Any) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.qtype = num_embeddings, dim, qtype
        self.weight = _uint8_param(num_embeddings, row_bytes(qtype, dim))
        self.kernels = kernels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        qt = QTYPES[self.qtype][0]
        rows: torch.Tensor = self.kernels.dequantize(self.weight, qt, self.embedding_dim, ids.reshape(-1))
        return rows.view(*ids.shape, self.embedding_dim)


def swap_modules(model: nn.Module, qtypes: dict[str, str], kernels: Any) -> None:
    """Replace the nn.Linear/nn.Embedding named in qtypes ({"layers.0.attention.wq": "q4_1", ...}) on a meta model."""
    for name, qtype in qtypes.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, leaf)
        new: nn.Module
        if isinstance(old, nn.Linear):
            new = QLinear(old.in_features, old.out_features, qtype, old.bias is not None, kernels)
        elif isinstance(old, nn.Embedding):
            new = QEmbedding(old.num_embeddings, old.embedding_dim, qtype, kernels)
        else:
            raise TypeError(f"{name} is a {type(old).__name__}; only Linear and Embedding can be quantized")
        setattr(parent, leaf, new)


def quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """ggml's blocks of a float (N, K) matrix with ggml's own rounding (gguf.quants): uint8 (N, row_bytes)."""
    import gguf

    row_bytes(qtype, w.shape[-1])
    kind = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
            "q8_0": gguf.GGMLQuantizationType.Q8_0}[qtype]
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w.float().numpy(), kind)))


def dequantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 (N, K) from uint8 blocks (N, row_bytes), in numpy (gguf.quants): the reference and no-compiler path."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype.upper()]
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(w.numpy(), kind), dtype=np.float32))
