"""The C++ vision encoder (`VisionTower`, webchat/kernels/cpu/csrc/vision.cpp) built from a projector file's tensors.

exact: every matrix in float32 (F16, BF16 and Q8_0 converted once here); one whose values each split exactly into two
bfloat16 (every F16 and BF16 weight) takes the split-bfloat16 GEMM on AMX where the CPU has it (csrc/vgemm.cpp, about
1e-5 relative), any other torch's sgemm; the results stay within 1e-5 of the PyTorch encoder.
int8: the layer matrices and idefics3's projection as Q8_0 blocks (the file's own where it holds Q8_0, F16 and BF16
rounded to Q8_0 here by ggml's rule, `gguf.quants.quantize`) against 8-bit activation rows (a scale per 8 values); a
matrix whose k is not a multiple of 32 (Gemma 3's 4304-wide ffn_down) stays float32. The patch embedding and gemma3's
projection (k = D, kept float16 by the converter) stay float32 on both paths.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import torch

from webchat.kernels.cpu.build import QKernels, VisionHandle
from webchat.vision.projector_file import ProjectorFile
from webchat.vision.weights import Q8_0, Raw, as_float, file_bytes, raw

F32 = 0
PRECISIONS = ("exact", "int8")


def build_tower(kernels: QKernels, pf: ProjectorFile, precision: str, amx: bool | None = None) -> VisionHandle:
    """The compiled encoder over `pf`'s weights at `precision` (exact or int8); `amx` (default: unless
    WEBCHAT_VISION_AMX=0) lets exact matrices that split into two bfloat16 take the AMX GEMM where the CPU has it."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    c = pf.config
    w = _vectors(pf)
    mapped = file_bytes(pf)
    embed = [w["patch.weight"].reshape(c.width, -1).contiguous(), w["patch.bias"], w["pos"], w["post_ln.weight"],
             w["post_ln.bias"]]
    if c.kind == "gemma3":
        embed.append(w["proj.norm"])
    norms, mats, qtypes, biases = [], [], [], []
    for i in range(c.layers):
        norms += [w[f"{i}.ln1.weight"], w[f"{i}.ln1.bias"], w[f"{i}.ln2.weight"], w[f"{i}.ln2.bias"]]
        qkv = [raw(pf, f"{i}.{m}.weight", mapped) for m in ("q", "k", "v")]
        for r in ([_concat(qkv)] + [raw(pf, f"{i}.{m}.weight", mapped) for m in ("out", "up", "down")]):
            m, t = _matrix(r, precision)
            mats.append(m)
            qtypes.append(t)
        biases += [torch.cat([w[f"{i}.{m}.bias"] for m in ("q", "k", "v")]), w[f"{i}.out.bias"], w[f"{i}.up.bias"],
                   w[f"{i}.down.bias"]]
    proj = raw(pf, "proj.weight", mapped)
    if c.kind == "gemma3":  # the file's (D, T) rows of T; the tower takes (T, D)
        mats.append(as_float(proj).t().contiguous())
        qtypes.append(F32)
    else:
        m, t = _matrix(proj, precision)
        mats.append(m)
        qtypes.append(t)
    dims = [0 if c.kind == "idefics3" else 1, c.image_size, c.patch_size, c.width, c.ffn, c.layers, c.heads, c.text_dim,
            c.scale_factor]
    if amx is None:
        amx = os.environ.get("WEBCHAT_VISION_AMX", "").strip() != "0"
    return kernels.VisionTower(dims, c.eps, embed, norms, mats, qtypes, biases, amx)


def _vectors(pf: ProjectorFile) -> dict[str, torch.Tensor]:
    """The float32 tensors the tower reads as they are: everything but the layer matrices and the projection."""
    mapped = file_bytes(pf)
    out: dict[str, torch.Tensor] = {}
    for name, t in pf.tensors.items():
        if name.endswith((".q.weight", ".k.weight", ".v.weight", ".out.weight", ".up.weight", ".down.weight")):
            continue
        if name == "proj.weight":
            continue
        out[name] = as_float(raw(pf, name, mapped)).reshape(tuple(reversed(t.shape))).contiguous()
    return out


def _concat(parts: list[Raw]) -> Raw:
    """q, k and v as one (3D, D) matrix in one type (a mix is made float32)."""
    if len({p.ggml_type for p in parts}) == 1:
        return Raw(torch.cat([p.data for p in parts]), parts[0].ggml_type, sum(p.rows for p in parts), parts[0].k)
    return Raw(torch.cat([as_float(p) for p in parts]), int(gguf.GGMLQuantizationType.F32),
               sum(p.rows for p in parts), parts[0].k)


def _matrix(r: Raw, precision: str) -> tuple[torch.Tensor, int]:
    """(tensor, ggml type) for the tower: float32 (exact, or k not a multiple of 32), else Q8_0 blocks."""
    if precision == "exact" or r.k % 32:
        return as_float(r).contiguous(), F32
    if r.ggml_type == Q8_0:
        return r.data.contiguous(), Q8_0
    blocks = gguf.quants.quantize(as_float(r).numpy(), gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(blocks)), Q8_0
