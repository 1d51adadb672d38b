"""Quantized weights behind one seam: QLinear/QEmbedding swapped in before load_state_dict (docs/quant.md).

A quantized weight is a uint8 tensor (out_features, K/32 * block_bytes) holding ggml's blocks row by row, unchanged;
its format (q4_0, q4_1, q5_0, q5_1, q8_0; q4_k, q5_k, q6_k from GGUF files) lives on the module. Activations are
float32, or with `int8` set (webchat.model.precision) quantized to 8 bits a row at a time (webchat.kernels.cpu.build).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from webchat.gguf.blocks import K_QTYPES, QTYPES, row_bytes


class BlockKernels(Protocol):
    """What the quantized modules and their precision use of the C++ kernels (webchat.kernels.cpu.build.BlockKernels,
    which the kernels' loader hands in): the model layer names the seam, the kernels layer fills it."""

    def qmatmul(self, x: torch.Tensor, w: torch.Tensor, qtype: int, k: int, bias: torch.Tensor | None = None,
                gemm: bool = False, int8: bool = False, packed: bool = False, x2: bool = False,
                amx: bool = False) -> torch.Tensor: ...  # fmt: skip

    def dequantize(self, w: torch.Tensor, qtype: int, k: int, ids: torch.Tensor | None = None) -> torch.Tensor: ...

    def unpacked_rows(self, w: torch.Tensor, qtype: int, ids: torch.Tensor) -> torch.Tensor: ...

    def repack8(self, w: torch.Tensor, qtype: int, pack: bool) -> None: ...

    def packs8(self, qtype: int, n: int) -> bool: ...

# (rows,) bool or None: within exact_rows(), the rows of a QLinear's input multiplied at float32 whatever its precision
_EXACT_ROWS: ContextVar[torch.Tensor | None] = ContextVar("webchat_exact_rows", default=None)


@contextmanager
def exact_rows(mask: torch.Tensor | None) -> Iterator[None]:
    """Within: a QLinear at int8 or int8x2 multiplies the rows of its input where `mask` (rows,) is True at float32,
    through the GEMM the C++ forward takes for them (a prompt scored, webchat.model.batch.Batch.exact); None: none."""
    token = _EXACT_ROWS.set(mask)
    try:
        yield
    finally:
        _EXACT_ROWS.reset(token)


def exact_mask() -> torch.Tensor | None:
    """The mask exact_rows() set, or None."""
    return _EXACT_ROWS.get()


GEMM_ROWS = 32  # from this many rows of x, QLinear dequantizes the matrix and calls torch's float32 GEMM
GEMM_MAX_WEIGHTS = 4 << 20  # ... a tile of at most this many weights at a time (a 16 MB float32 copy)


def _compiled(kernels: BlockKernels | None, qtype: str) -> BlockKernels:
    if kernels is None:
        raise RuntimeError(f"{qtype} weights need webchat's C++ kernels, which could not be built here")
    return kernels


def _uint8_param(rows: int, nbytes: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, nbytes, dtype=torch.uint8), requires_grad=False)


class QLinear(nn.Module):
    """y = x @ dequant(weight).T (+ bias) with weight (out_features, row_bytes) uint8 blocks; x (..., in_features)."""

    def __init__(self, in_features: int, out_features: int, qtype: str, bias: bool,
                 kernels: BlockKernels | None) -> None:
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
            kernels = _compiled(self.kernels, self.qtype)
            mask = _EXACT_ROWS.get()
            if mask is None:
                y8 = kernels.qmatmul(x2, self.weight, qt, self.in_features, self.bias, int8=True, packed=self.packed,
                                     x2=self.x2)
                return y8.view(*lead, self.out_features)
            assert mask.shape == (x2.shape[0],), f"exact rows mask {tuple(mask.shape)} for {x2.shape[0]} rows"
            exact, rest = mask.nonzero().squeeze(1), (~mask).nonzero().squeeze(1)
            ym = torch.empty(x2.shape[0], self.out_features)
            ym[exact] = kernels.qmatmul(x2[exact], self.weight, qt, self.in_features, self.bias, gemm=True,
                                       packed=self.packed, amx=True)
            if rest.numel():
                ym[rest] = kernels.qmatmul(x2[rest], self.weight, qt, self.in_features, self.bias, int8=True,
                                          packed=self.packed, x2=self.x2)
            return ym.view(*lead, self.out_features)
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

    def __init__(self, num_embeddings: int, dim: int, qtype: str, kernels: BlockKernels | None) -> None:
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


def swap_modules(model: nn.Module, qtypes: dict[str, str], kernels: BlockKernels | None) -> None:
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
