"""A projector file's tensors as torch tensors: float32 for the PyTorch encoder, the file's bytes for the C++ one."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from webchat.vision.projector_file import ProjectorFile

Q8_0 = int(gguf.GGMLQuantizationType.Q8_0)
F16 = int(gguf.GGMLQuantizationType.F16)
F32 = int(gguf.GGMLQuantizationType.F32)
BF16 = int(gguf.GGMLQuantizationType.BF16)


@dataclass(frozen=True)
class Raw:
    """A matrix as the file holds it: (rows, row bytes) uint8 for Q8_0, (rows, k) float16/float32 otherwise."""

    data: torch.Tensor
    ggml_type: int
    rows: int  # ggml ne1
    k: int  # ggml ne0: the contiguous axis


def file_bytes(pf: ProjectorFile) -> np.ndarray:
    """The whole file, mapped read-only."""
    return np.memmap(pf.path, dtype=np.uint8, mode="r")


def raw(pf: ProjectorFile, name: str, mapped: np.ndarray | None = None) -> Raw:
    """Tensor `name` (ours) in the file's own type, copied out of the mapping."""
    t = pf.tensors[name]
    buf = (mapped if mapped is not None else file_bytes(pf))[t.offset:t.offset + t.nbytes]
    k, rows = t.shape[0], t.nbytes // max(1, _row_bytes(t.ggml_type, t.shape[0]))
    if t.ggml_type == Q8_0:
        data = torch.from_numpy(np.array(buf).reshape(rows, -1))
    elif t.ggml_type == F16:
        data = torch.from_numpy(np.array(buf).view(np.float16).reshape(rows, k))
    elif t.ggml_type == BF16:
        bits = np.array(buf).view(np.uint16).astype(np.uint32) << 16
        data = torch.from_numpy(bits.view(np.float32).reshape(rows, k))
    else:
        data = torch.from_numpy(np.array(buf).view(np.float32).reshape(rows, k))
    return Raw(data, t.ggml_type, rows, k)


def as_float(r: Raw) -> torch.Tensor:
    """The matrix in float32, (rows, k): Q8_0 dequantized as ggml does (d * q)."""
    if r.ggml_type == Q8_0:
        return torch.from_numpy(gguf.quants.dequantize(r.data.numpy(), gguf.GGMLQuantizationType.Q8_0)).reshape(r.rows,
                                                                                                               r.k)
    return r.data.float()


def float_weights(pf: ProjectorFile) -> dict[str, torch.Tensor]:
    """Every tensor in float32, in PyTorch's layout (the ggml shape reversed): (out, in) matrices, (D, 3, p, p)
    patch kernel, (P, D) positions; gemma3's projection (D, T), used as x @ W."""
    mapped = file_bytes(pf)
    out: dict[str, torch.Tensor] = {}
    for name, t in pf.tensors.items():
        out[name] = as_float(raw(pf, name, mapped)).reshape(tuple(reversed(t.shape))).contiguous()
    return out


def _row_bytes(ggml_type: int, k: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    return k // block * size
