"""Quantized weights behind one seam: QLinear/QEmbedding swapped in before load_state_dict (docs/quant.md).

A quantized weight is a uint8 tensor (out_features, K/32 * block_bytes) holding ggml's blocks row by row, unchanged;
its format (q4_0, q4_1, q5_0, q5_1, q8_0; q4_k, q5_k, q6_k from GGUF files) lives on the module. Activations are
float32, or with `int8` set (webchat.model.precision) quantized to 8 bits a row at a time (webchat.kernels.cpu.build).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from webchat.kernels.cpu.build import QKernels

# name → (ggml type number, bytes per block of 32 weights)
QTYPES: dict[str, tuple[int, int]] = {"q4_0": (2, 18), "q4_1": (3, 20), "q5_0": (6, 22), "q5_1": (7, 24),
                                      "q8_0": (8, 34)}
BLOCK = 32
# K-quants from GGUF files: name → (ggml type number, bytes per 256-value super-block); kernels/cpu/csrc/qkquant.cpp
K_QTYPES: dict[str, tuple[int, int]] = {"q4_k": (12, 144), "q5_k": (13, 176), "q6_k": (14, 210)}
QK_K = 256
ALL_QTYPES = (*QTYPES, *K_QTYPES)
GEMM_ROWS = 32  # from this many rows of x, QLinear dequantizes the matrix and calls torch's float32 GEMM
GEMM_MAX_WEIGHTS = 4 << 20  # ... a tile of at most this many weights at a time (a 16 MB float32 copy)


def row_bytes(qtype: str, k: int) -> int:
    if qtype in K_QTYPES:  # 256-value super-blocks
        if k % QK_K:
            raise ValueError(f"{qtype} rows need a multiple of {QK_K} columns, got {k}")
        return k // QK_K * K_QTYPES[qtype][1]
    if qtype not in QTYPES:
        raise ValueError(f"quantized type must be one of {', '.join(ALL_QTYPES)}, got {qtype!r}")
    if k % BLOCK:
        raise ValueError(f"{qtype} rows need a multiple of {BLOCK} columns, got {k}")
    return k // BLOCK * QTYPES[qtype][1]


def _compiled(kernels: QKernels | None, qtype: str) -> QKernels:
    if kernels is None:
        raise RuntimeError(f"{qtype} weights need webchat's C++ kernels, which could not be built here")
    return kernels


def _uint8_param(rows: int, nbytes: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, nbytes, dtype=torch.uint8), requires_grad=False)


class QLinear(nn.Module):
    """y = x @ dequant(weight).T (+ bias) with weight (out_features, row_bytes) uint8 blocks; x (..., in_features)."""

    def __init__(self, in_features: int, out_features: int, qtype: str, bias: bool, kernels: QKernels | None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.weight = _uint8_param(out_features, row_bytes(qtype, in_features))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernels = kernels
        self.int8 = False  # x's rows at 8 bits and the int8 kernels, every row alike (webchat.model.precision)
        self.x2 = False  # with int8: each row as two 8-bit rows, the value and its rounding's residual (int8x2)
        self.packed = False  # weight rows packed 8 to a group for the int8 kernels (kernels/cpu/csrc/qpack8.cpp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2 = x.shape[:-1], x.reshape(-1, self.in_features)
        if self.int8:
            qt = ({**QTYPES, **K_QTYPES})[self.qtype][0]
            y8 = _compiled(self.kernels, self.qtype).qmatmul(x2, self.weight, qt, self.in_features, self.bias,
                                                             int8=True, packed=self.packed, x2=self.x2)
            return y8.view(*lead, self.out_features)
        if x2.shape[0] >= GEMM_ROWS:  # prefill: torch's sgemm on dequantized rows (float32, exact)
            return self._gemm(x2).view(*lead, self.out_features)
        if self.qtype in K_QTYPES:  # kernels/cpu/csrc/qkquant.cpp: one dequantized block dotted with every row
            y: torch.Tensor = torch.ops.webchat_kq.matmul(x2, self.weight, K_QTYPES[self.qtype][0], self.in_features,
                                                          self.bias)
        else:
            kernels = _compiled(self.kernels, self.qtype)
            y = kernels.qmatmul(x2, self.weight, QTYPES[self.qtype][0], self.in_features, self.bias)
        return y.view(*lead, self.out_features)

    def _dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed:
            raise RuntimeError("this matrix's rows are packed for the int8 kernels; set_precision(model, 'exact') "
                               "puts them back in ggml's layout")
        if self.qtype in K_QTYPES:
            deq: torch.Tensor = torch.ops.webchat_kq.dequantize(rows, K_QTYPES[self.qtype][0], self.in_features)
            return deq
        return _compiled(self.kernels, self.qtype).dequantize(rows, QTYPES[self.qtype][0], self.in_features)

    def _gemm(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 (M, K) @ dequant(weight)^T for M >= GEMM_ROWS: the matrix dequantized a tile of rows at a time (at most
        GEMM_MAX_WEIGHTS floats, so the transient copy stays ~16 MB whatever the model), each tile one sgemm of all M
        rows (a 1.1B model's 11.5M-weight FFN matrices no longer fall back to the matrix-vector kernel)."""
        n, k = self.out_features, self.in_features
        tile = max(1, GEMM_MAX_WEIGHTS // k)
        if n <= tile:
            return F.linear(x2, self._dequantize(self.weight), self.bias)
        yt = torch.empty(n, x2.shape[0], dtype=x2.dtype)  # y transposed: each tile writes whole rows of it
        xt = x2.t()
        for r0 in range(0, n, tile):
            torch.mm(self._dequantize(self.weight[r0:r0 + tile]), xt, out=yt[r0:r0 + tile])
        if self.bias is not None:
            yt.add_(self.bias[:, None])  # in place, before the one copy that transposes
        return yt.t().contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"


class QEmbedding(nn.Module):
    """Rows of a quantized (num_embeddings, row_bytes) table, dequantized to float32 as they are looked up."""

    def __init__(self, num_embeddings: int, dim: int, qtype: str, kernels: QKernels | None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.qtype = num_embeddings, dim, qtype
        self.weight = _uint8_param(num_embeddings, row_bytes(qtype, dim))
        self.kernels = kernels
        self.packed = False  # the table is a tied head's, packed 8 rows to a group for the int8 kernels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed:  # the looked-up rows gathered back into the file's layout, then dequantized as below
            qt = {**QTYPES, **K_QTYPES}[self.qtype][0]
            rows = _compiled(self.kernels, self.qtype).unpacked_rows(self.weight, qt, ids.reshape(-1))
            if self.qtype in K_QTYPES:
                deq: torch.Tensor = torch.ops.webchat_kq.dequantize(rows, qt, self.embedding_dim)
            else:
                deq = _compiled(self.kernels, self.qtype).dequantize(rows, qt, self.embedding_dim)
            return deq.view(*ids.shape, self.embedding_dim)
        if self.qtype in K_QTYPES:
            blocks = self.weight.index_select(0, ids.reshape(-1))
            k_rows: torch.Tensor = torch.ops.webchat_kq.dequantize(blocks, K_QTYPES[self.qtype][0], self.embedding_dim)
            return k_rows.view(*ids.shape, self.embedding_dim)
        qt = QTYPES[self.qtype][0]
        rows = _compiled(self.kernels, self.qtype).dequantize(self.weight, qt, self.embedding_dim, ids.reshape(-1))
        return rows.view(*ids.shape, self.embedding_dim)


def swap_modules(model: nn.Module, qtypes: dict[str, str], kernels: QKernels | None) -> None:
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




def dequantize_k(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 (N, K) from ggml Q4_K, Q5_K or Q6_K blocks, uint8 (N, K / 256 * block bytes), with ggml's arithmetic."""
    if qtype not in K_QTYPES:
        raise ValueError(f"K-quant type must be one of {', '.join(K_QTYPES)}, got {qtype!r}")
    nbytes = K_QTYPES[qtype][1]
    if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] % nbytes:
        raise ValueError(f"{qtype} blocks must be uint8 (rows, k * {nbytes}), got {w.dtype} {tuple(w.shape)}")
    n = w.shape[0]
    b = w.reshape(-1, nbytes)
    y = _dequant_q6_k(b) if qtype == "q6_k" else _dequant_q45_k(b, qtype == "q5_k")
    return y.reshape(n, -1)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(B, 2) little-endian half-precision bytes → float32 (B,)."""
    return b.contiguous().view(torch.float16).reshape(-1).float()


def _dequant_q45_k(b: torch.Tensor, five: bool) -> torch.Tensor:
    # block: d, dmin (f16), scales[12] (eight 6-bit scale/min pairs), [Q5_K: qh[32], bit j of qh[l] the fifth bit of
    # value l of sub-block j], qs[128]; x = d*sc_j * q - dmin*m_j, j of 32
    d, dmin, s = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16].int()
    qs = b[:, 48:176].int() if five else b[:, 16:144].int()
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], dim=1)  # (B, 8)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    q = torch.stack([qs.view(-1, 4, 32) & 0xF, qs.view(-1, 4, 32) >> 4], dim=2).reshape(-1, 8, 32)  # sub-block j
    if five:
        qh = b[:, 16:48].int()  # (B, 32)
        q = q | torch.stack([((qh >> j) & 1) << 4 for j in range(8)], dim=1)
    d1 = (d[:, None] * sc.float())[..., None]  # (B, 8, 1)
    m1 = (dmin[:, None] * mn.float())[..., None]
    return (d1 * q.float() - m1).reshape(-1, QK_K)


def _dequant_q6_k(b: torch.Tensor) -> torch.Tensor:
    # block: ql[128] low nibbles, qh[64] high 2-bit pairs, scales[16] int8, d (f16); x = d*sc_g * (q - 32), g of 16
    ql, qh = b[:, 0:128].int().view(-1, 2, 64), b[:, 128:192].int().view(-1, 2, 32)
    sc, d = b[:, 192:208].contiguous().view(torch.int8).float(), _f16(b[:, 208:210])
    lo = torch.stack([ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=2)
    hi = torch.stack([(qh >> (2 * i)) & 3 for i in range(4)], dim=2)  # (B, half, quarter, 32)
    q = ((lo | (hi << 4)) - 32).reshape(-1, 16, 16).float()  # value v = 128 half + 32 quarter + l: group v // 16
    return ((d[:, None] * sc)[..., None] * q).reshape(-1, QK_K)


def quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """ggml's blocks of a float (N, K) matrix with ggml's own rounding (gguf.quants): uint8 (N, row_bytes)."""
    import gguf

    row_bytes(qtype, w.shape[-1])
    if qtype not in QTYPES:
        raise ValueError(f"webchat quantizes to {', '.join(QTYPES)} (gguf.quants' encoders), got {qtype!r}")
    kind = gguf.GGMLQuantizationType[qtype.upper()]
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w.float().numpy(), kind)))


def dequantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 (N, K) from uint8 blocks (N, row_bytes), in numpy (gguf.quants): the reference and no-compiler path."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype.upper()]
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(w.numpy(), kind), dtype=np.float32))
