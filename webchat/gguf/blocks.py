"""ggml's block formats as GGUF files hold them: each format's bytes per block, a row's bytes, and the reference
(de)quantizers (gguf.quants for the 32-value formats; K-quants decoded here with ggml's arithmetic).

    row_bytes("q4_k", 4096) -> 2304
    dequantize(blocks, "q4_1"), dequantize_k(blocks, "q6_k"), quantize(w, "q8_0")
"""

from __future__ import annotations

import numpy as np
import torch

# name → (ggml type number, bytes per block of 32 weights)
QTYPES: dict[str, tuple[int, int]] = {"q4_0": (2, 18), "q4_1": (3, 20), "q5_0": (6, 22), "q5_1": (7, 24),
                                      "q8_0": (8, 34)}
BLOCK = 32
# K-quants from GGUF files: name → (ggml type number, bytes per 256-value super-block); kernels/cpu/csrc/qkquant.cpp
K_QTYPES: dict[str, tuple[int, int]] = {"q4_k": (12, 144), "q5_k": (13, 176), "q6_k": (14, 210)}
QK_K = 256
ALL_QTYPES = (*QTYPES, *K_QTYPES)

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
