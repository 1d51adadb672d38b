"""Test helper: a tiny projector GGUF written with gguf's GGUFWriter in the converter's layout (keys, names, ggml
shapes), random weights, each key or tensor replaceable so a test can make it hostile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

TINY = {"image_size": 32, "patch_size": 8, "width": 32, "ffn": 64, "layers": 2, "heads": 2, "text_dim": 24,
        "scale_factor": 2}


def keys(kind: str, dims: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "general.architecture": "clip", "general.type": "mmproj", "clip.has_vision_encoder": True,
        "clip.projector_type": kind, "clip.use_gelu": True,
        "clip.vision.image_size": dims["image_size"], "clip.vision.patch_size": dims["patch_size"],
        "clip.vision.embedding_length": dims["width"], "clip.vision.feed_forward_length": dims["ffn"],
        "clip.vision.block_count": dims["layers"], "clip.vision.attention.head_count": dims["heads"],
        "clip.vision.projection_dim": dims["text_dim"], "clip.vision.attention.layer_norm_epsilon": 1e-6,
        "clip.vision.image_mean": [0.5, 0.5, 0.5], "clip.vision.image_std": [0.5, 0.5, 0.5],
        "clip.vision.projector.scale_factor": dims["scale_factor"],
    }
    if kind == "idefics3":
        out["clip.vision.preproc_image_size"] = 4 * dims["image_size"]
    return out


def tensors(kind: str, dims: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    """numpy arrays in PyTorch's layout (the writer reverses the shape into ggml's order)."""
    rng = np.random.default_rng(seed)
    d, f, p, t, s = dims["width"], dims["ffn"], dims["patch_size"], dims["text_dim"], dims["scale_factor"]
    n_patches = (dims["image_size"] // p) ** 2

    def r(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    out = {"v.patch_embd.weight": r(d, 3, p, p), "v.patch_embd.bias": r(d), "v.position_embd.weight": r(n_patches, d),
           "v.post_ln.weight": 1 + r(d), "v.post_ln.bias": r(d)}
    for i in range(dims["layers"]):
        b = f"v.blk.{i}."
        out |= {b + "ln1.weight": 1 + r(d), b + "ln1.bias": r(d), b + "ln2.weight": 1 + r(d), b + "ln2.bias": r(d)}
        for m in ("q", "k", "v", "out"):
            out[f"{b}attn_{m}.weight"], out[f"{b}attn_{m}.bias"] = r(d, d), r(d)
        out |= {b + "ffn_up.weight": r(f, d), b + "ffn_up.bias": r(f), b + "ffn_down.weight": r(d, f),
                b + "ffn_down.bias": r(d)}
    if kind == "idefics3":
        out["mm.model.fc.weight"] = r(t, d * s * s)
    else:
        out["mm.input_projection.weight"], out["mm.soft_emb_norm.weight"] = r(d, t), 1 + r(d)
    return out


def write_projector(path: Path, kind: str = "idefics3", seed: int = 0, dims: dict[str, int] | None = None,
                    meta: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
                    replace: dict[str, np.ndarray] | None = None, f16: bool = True) -> Path:
    """A projector file; `meta` overrides keys (None deletes one), `drop` leaves tensors out, `replace` swaps them.
    Matrices are F16 when `f16`, vectors F32 (as the converter writes them)."""
    dims = {**TINY, **(dims or {})}
    kv = keys(kind, dims)
    for k, v in (meta or {}).items():
        if v is None:
            kv.pop(k, None)
        else:
            kv[k] = v
    w = gguf.GGUFWriter(str(path), "clip")
    for k, v in kv.items():
        if k == "general.architecture":
            continue
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, v)
    ts = {**tensors(kind, dims, seed), **(replace or {})}
    for name, arr in ts.items():
        if name in drop:
            continue
        matrix = arr.ndim == 2 and "position" not in name
        w.add_tensor(name, arr.astype(np.float16) if f16 and matrix and arr.dtype == np.float32 else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
