"""How the KV cache stores each k and v row (`--kv-cache`, llama.cpp's `-ctk/-ctv` names):

    f32   float32, as computed
    f16   IEEE half (round to nearest even), half the bytes
    q8_0  ggml's block_q8_0 per 32 values of a head, of the values' Walsh-Hadamard transform: y = H x (H the 32-point
          +-1 matrix, H H = 32 I), then a float16 scale d = max|y| / 127 and 32 int8 q = round(y / d) (half away from
          zero, y times 1 / d in float32, as ggml's quantize_row_q8_0_ref); read back as H (q d) / 32. 34 bytes per 32
          values: 17/32 of f16's bytes. The transform spreads a head's few large channels (RoPE'd keys have them) over
          the block, so one channel no longer sets the step of the other 31 (QuaRot's rotation, arXiv:2404.00456)

A pool's tensors say which: float32, float16, or uint8 rows of n_kv * row_bytes(hd) bytes (a q8_0 head's blocks in
order), so every reader (the PyTorch ops, the C++ step, page copies) knows the format from the tensor alone. Attention
reads a row back as float32 (`decode`) and computes as with a float32 cache; the C++ step (kernels/cpu/csrc/qstep.cpp)
stores and reads the same bytes and the same floats.
"""

from __future__ import annotations

import torch

KV_CACHE_TYPES = ("f32", "f16", "q8_0")
DEFAULT_KV_CACHE = "f32"
Q8_BLOCK = 32  # values a q8_0 block
Q8_BYTES = 34  # its float16 scale and 32 int8


def check(kind: str, head_dim: int) -> None:
    """A clear error for a type that is not one, or a q8_0 cache on heads that are not whole blocks."""
    if kind not in KV_CACHE_TYPES:
        raise ValueError(f"--kv-cache must be one of {', '.join(KV_CACHE_TYPES)}, got {kind!r}")
    if kind == "q8_0" and head_dim % Q8_BLOCK:
        raise ValueError(f"--kv-cache q8_0 needs a head size that is a multiple of {Q8_BLOCK}; this model's is "
                         f"{head_dim} (use f16)")


def storage(kind: str, head_dim: int) -> tuple[torch.dtype, int]:
    """(element dtype, elements per head row) of a pool that stores rows as `kind`."""
    check(kind, head_dim)
    if kind == "q8_0":
        return torch.uint8, head_dim // Q8_BLOCK * Q8_BYTES
    return (torch.float16 if kind == "f16" else torch.float32), head_dim


def row_bytes(kind: str, head_dim: int) -> int:
    dtype, n = storage(kind, head_dim)
    return n * torch.empty((), dtype=dtype).element_size()


def share_of_f32(kind: str) -> float:
    """A row's bytes in `kind` over its float32 bytes (f16 0.5, q8_0 34/128), for any head of whole q8_0 blocks."""
    return row_bytes(kind, Q8_BLOCK) / row_bytes("f32", Q8_BLOCK)


def kind_name(dtype: torch.dtype) -> str:
    """What a pool of `dtype` is called (/api/info): one of KV_CACHE_TYPES, or the dtype (a GPU model's bf16 pool)."""
    names = {torch.float32: "f32", torch.float16: "f16", torch.uint8: "q8_0"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """H x of each 32 values (..., 32), unnormalised: butterflies (a + b, a - b) of the pairs h = 1, 2, 4, 8, 16 apart,
    in that order (the C++ step's order, so both make the same floats)."""
    shape = x.shape
    for h in (1, 2, 4, 8, 16):
        y = x.reshape(*shape[:-1], Q8_BLOCK // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(shape)
    return x


def encode(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows x (..., hd) as the pool tensor `like` stores them: in its dtype, or (..., row bytes) of q8_0 blocks."""
    if like.dtype != torch.uint8:
        return x.to(like.dtype)
    xf = x.float()
    blocks = hadamard(xf.reshape(*xf.shape[:-1], -1, Q8_BLOCK))  # (..., nb, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    y = blocks * inv
    t = torch.trunc(y)  # roundf, half away from zero (y - t is exact; floor(|y| + 0.5) would round 0.5 - 2^-25 up)
    q = (t + torch.sign(y) * ((y - t).abs() >= 0.5)).to(torch.int8)
    out = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)  # (..., nb, 34)
    return out.reshape(*xf.shape[:-1], -1)


def decode(rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., hd) in `dtype` of stored rows (..., hd or row bytes): what attention reads (q8_0: q * d in float32)."""
    if rows.dtype != torch.uint8:
        return rows.to(dtype)
    blocks = rows.reshape(*rows.shape[:-1], -1, Q8_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # (..., nb, 1)
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (hadamard(q * d) * (1.0 / Q8_BLOCK)).reshape(*rows.shape[:-1], head_dim).to(dtype)
