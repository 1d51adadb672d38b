"""Test helper: an encoder of our own for ggml's Q4_K, Q5_K and Q6_K blocks (gguf.quants only decodes them).

Any valid encoding tests a decoder; this one is plain round-to-nearest, not llama.cpp's searched scales.
Q4_K: 256 values in 144 bytes: d, dmin (f16), 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of 4-bit q;
x = d * sc_j * q - dmin * m_j per sub-block j of 32. Q6_K: 256 values in 210 bytes: 128 bytes of low nibbles, 64 of
high 2-bit pairs, sixteen int8 scales, d (f16); x = d * sc_g * (q - 32) per group g of 16.
"""

from __future__ import annotations

import numpy as np

QK = 256


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % QK:
        raise ValueError(f"K-quant rows need a multiple of {QK} values, got {x.shape[-1]}")
    return x.reshape(-1, QK)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """uint8 (rows, K / 256 * 144) ggml Q4_K blocks of float rows x (rows, K)."""
    return _encode_q45_k(x, 15)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    """uint8 (rows, K / 256 * 176) ggml Q5_K blocks: Q4_K's with 32 levels, the fifth bit of value l of sub-block j
    in bit j of qh[l]."""
    return _encode_q45_k(x, 31)


def _encode_q45_k(x: np.ndarray, levels: int) -> np.ndarray:
    rows = x.shape[0] if x.ndim > 1 else 1
    b = _blocks(x).reshape(-1, 8, 32)  # (B, sub-block, value)
    lo = np.minimum(b.min(-1), 0.0)  # (B, 8)
    scale = (b.max(-1) - lo) / float(levels)
    d = _f16(scale.max(-1) / 63.0)  # (B,)
    dmin = _f16(-lo.min(-1) / 63.0)
    df, dminf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, df[:, None], out=np.zeros_like(scale), where=df[:, None] > 0)), 0, 63)
    mn = np.clip(np.rint(np.divide(-lo, dminf[:, None], out=np.zeros_like(lo), where=dminf[:, None] > 0)), 0, 63)
    step = df[:, None] * sc  # (B, 8)
    q = np.rint(np.divide(b + (dminf[:, None] * mn)[..., None], step[..., None],
                          out=np.zeros_like(b), where=step[..., None] > 0))
    q = np.clip(q, 0, levels).astype(np.uint8)  # (B, 8, 32)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    packed = np.zeros((b.shape[0], 12), np.uint8)
    packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)  # chunk j: low nibble sub-block 2j, high 2j + 1
    head = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed]
    if levels == 31:
        qh = np.zeros((b.shape[0], 32), np.uint8)
        for j in range(8):
            qh |= ((q[:, j] >> 4) & 1).astype(np.uint8) << j
        head.append(qh)
    return np.concatenate([*head, qs], axis=1).reshape(rows, -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """uint8 (rows, K / 256 * 210) ggml Q6_K blocks of float rows x (rows, K)."""
    rows = x.shape[0] if x.ndim > 1 else 1
    b = _blocks(x).reshape(-1, 16, 16)  # (B, group, value)
    scale = np.abs(b).max(-1) / 31.0  # (B, 16)
    d = _f16(scale.max(-1) / 127.0)
    df = d.astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, df[:, None], out=np.zeros_like(scale), where=df[:, None] > 0)), -128, 127)
    step = (df[:, None] * sc)[..., None]
    q = np.rint(np.divide(b, step, out=np.zeros_like(b), where=step > 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # (B, half, quarter k, l): v = 32k + l
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2)  # (B, 2, 64)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                          d.view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(rows, -1)
