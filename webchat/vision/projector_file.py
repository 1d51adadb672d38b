"""A projector GGUF (`mmproj-*.gguf`, llama.cpp's convert_hf_to_gguf.py `--mmproj`) read with limits: its settings
by exact key into one dataclass, its tensors checked by name, shape and type against them before any is read.

    clip.projector_type = idefics3 | gemma3          (any other is refused by name)
    clip.vision.{image_size, patch_size, embedding_length, feed_forward_length, block_count, attention.head_count,
                 attention.layer_norm_epsilon, projection_dim, image_mean, image_std}
    clip.vision.projector.scale_factor               idefics3: the pixel shuffle (4 for SmolVLM); gemma3: the pooling
                                                     kernel, written only when it is not 4
    clip.vision.preproc_image_size                   idefics3: the longest edge images are resized to (2048;
                                                     4 tiles' worth when absent, as the processor's default)

Tensors (ggml order, ne0 first; the table `names` maps ours to the file's):
    v.patch_embd.weight (p, p, 3, D) + .bias (D)      v.position_embd.weight (D, P)
    v.blk.N.{ln1, ln2}.{weight, bias} (D)             v.blk.N.attn_{q, k, v, out}.{weight (D, D), bias (D)}
    v.blk.N.ffn_up.weight (D, F) + .bias (F)          v.blk.N.ffn_down.weight (F, D) + .bias (D)
    v.post_ln.{weight, bias} (D)
    idefics3: mm.model.fc.weight (D s^2, T)
    gemma3:   mm.input_projection.weight (T, D): y = x @ W as transformers has it; mm.soft_emb_norm.weight (D)
Matrices may be F32, F16, BF16 or Q8_0 (the converter's `--outtype f32|f16|bf16|q8_0`); vectors F32 or F16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from webchat.gguf.header import GGUFError, Header, TensorInfo, read_header

KINDS = ("idefics3", "gemma3")
MATRIX_TYPES = {"f32", "f16", "bf16", "q8_0"}
VECTOR_TYPES = {"f32", "f16"}
# bounds on every count a file declares: above each real model's, far below what would exhaust memory
BOUNDS = {"image_size": (16, 4096), "patch_size": (1, 64), "width": (8, 8192), "ffn": (8, 65536), "layers": (1, 128),
          "heads": (1, 256), "text_dim": (8, 65536), "scale_factor": (1, 16), "longest_edge": (16, 8192)}


class ProjectorError(ValueError):
    """A projector file webchat cannot use: the message names the file, the key or tensor, and what was expected."""


@dataclass(frozen=True)
class ProjectorConfig:
    """A projector's settings, from the GGUF's clip.* keys."""

    kind: str
    image_size: int
    patch_size: int
    width: int  # D
    ffn: int  # F
    layers: int
    heads: int
    eps: float
    text_dim: int  # T
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    scale_factor: int  # idefics3: pixel shuffle s; gemma3: average pooling kernel
    longest_edge: int  # idefics3: images resized to this longest edge first; gemma3: image_size
    side: int = field(init=False)  # patches a side
    tokens_per_tile: int = field(init=False)
    head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "side", self.image_size // self.patch_size)
        object.__setattr__(self, "tokens_per_tile", (self.side // self.scale_factor) ** 2)
        object.__setattr__(self, "head_dim", self.width // self.heads)

    @property
    def patches(self) -> int:
        return self.side * self.side


@dataclass
class ProjectorFile:
    """A projector GGUF's header, settings and tensor table (our names), read but with no tensor data loaded."""

    path: Path
    config: ProjectorConfig
    tensors: dict[str, TensorInfo]
    header: Header


def read_projector(path: Path) -> ProjectorFile:
    """The projector at `path`, every key and tensor checked; ProjectorError (or GGUFError) naming what is wrong."""
    path = Path(path)
    header = read_header(path)
    meta = header.metadata
    if meta.get("general.architecture") != "clip":
        raise ProjectorError(f"{path.name}: general.architecture is {meta.get('general.architecture')!r}; a projector "
                             "file (mmproj, written by convert_hf_to_gguf.py --mmproj) has 'clip'")
    config = read_config(path.name, meta)
    by_name = {t.name: t for t in header.tensors}
    tensors = {ours: _tensor(path.name, by_name, theirs, shape, vector)
               for ours, (theirs, shape, vector) in names(config).items()}
    return ProjectorFile(path, config, tensors, header)


def read_config(name: str, meta: dict[str, Any]) -> ProjectorConfig:
    kind = meta.get("clip.projector_type")
    if kind not in KINDS:
        raise ProjectorError(f"{name}: projector type {kind!r} is not supported; webchat reads {', '.join(KINDS)}")
    if meta.get("clip.has_vision_encoder") is not True:
        raise ProjectorError(f"{name}: clip.has_vision_encoder is {meta.get('clip.has_vision_encoder')!r}; expected "
                             "True (an audio-only projector has no image encoder)")
    v = "clip.vision."
    got = {"image_size": _int(name, meta, v + "image_size"), "patch_size": _int(name, meta, v + "patch_size"),
           "width": _int(name, meta, v + "embedding_length"), "ffn": _int(name, meta, v + "feed_forward_length"),
           "layers": _int(name, meta, v + "block_count"), "heads": _int(name, meta, v + "attention.head_count"),
           "text_dim": _int(name, meta, v + "projection_dim")}
    default_scale = 4 if kind == "gemma3" else None
    got["scale_factor"] = _int(name, meta, v + "projector.scale_factor", default_scale)
    # a file from before the converter wrote it: the processor's own default, 4 tiles a side (SmolVLM's 2048)
    got["longest_edge"] = (_int(name, meta, v + "preproc_image_size", 4 * got["image_size"]) if kind == "idefics3"
                           else got["image_size"])
    for key, value in got.items():
        lo, hi = BOUNDS[key]
        if not lo <= value <= hi:
            raise ProjectorError(f"{name}: {key} is {value}; expected {lo} to {hi}")
    if got["image_size"] % got["patch_size"] or got["width"] % got["heads"]:
        raise ProjectorError(f"{name}: image_size {got['image_size']} must be a multiple of patch_size "
                             f"{got['patch_size']} and width {got['width']} of the head count {got['heads']}")
    if (got["image_size"] // got["patch_size"]) % got["scale_factor"]:
        raise ProjectorError(f"{name}: {got['image_size'] // got['patch_size']} patches a side do not divide by the "
                             f"projector's scale factor {got['scale_factor']}")
    if kind == "idefics3" and got["longest_edge"] > 6 * got["image_size"]:
        raise ProjectorError(f"{name}: preproc_image_size {got['longest_edge']} makes more than 6 tiles a side of "
                             f"{got['image_size']}; the tokenizer's <row_r_col_c> tags go to 6")
    eps = meta.get(v + "attention.layer_norm_epsilon", 1e-6)
    if not isinstance(eps, float) or not 0 < eps < 1:
        raise ProjectorError(f"{name}: {v}attention.layer_norm_epsilon is {eps!r}; expected a float in (0, 1)")
    mean, std = _triple(name, meta, v + "image_mean"), _triple(name, meta, v + "image_std")
    if min(std) <= 0:
        raise ProjectorError(f"{name}: {v}image_std is {std}; expected three positive values")
    return ProjectorConfig(kind, got["image_size"], got["patch_size"], got["width"], got["ffn"], got["layers"],
                           got["heads"], eps, got["text_dim"], mean, std, got["scale_factor"], got["longest_edge"])


def names(c: ProjectorConfig) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """Our name -> (the file's name, its ggml shape, whether it is a vector) for every tensor the encoder reads."""
    d, f, p = c.width, c.ffn, c.patch_size
    table: dict[str, tuple[str, tuple[int, ...], bool]] = {
        "patch.weight": ("v.patch_embd.weight", (p, p, 3, d), True),  # read whole, as float32
        "patch.bias": ("v.patch_embd.bias", (d,), True),
        "pos": ("v.position_embd.weight", (d, c.patches), True),
        "post_ln.weight": ("v.post_ln.weight", (d,), True), "post_ln.bias": ("v.post_ln.bias", (d,), True),
    }
    for i in range(c.layers):
        b = f"v.blk.{i}."
        for ln in ("ln1", "ln2"):
            table[f"{i}.{ln}.weight"] = (f"{b}{ln}.weight", (d,), True)
            table[f"{i}.{ln}.bias"] = (f"{b}{ln}.bias", (d,), True)
        for m in ("q", "k", "v", "out"):
            table[f"{i}.{m}.weight"] = (f"{b}attn_{m}.weight", (d, d), False)
            table[f"{i}.{m}.bias"] = (f"{b}attn_{m}.bias", (d,), True)
        table[f"{i}.up.weight"] = (f"{b}ffn_up.weight", (d, f), False)
        table[f"{i}.up.bias"] = (f"{b}ffn_up.bias", (f,), True)
        table[f"{i}.down.weight"] = (f"{b}ffn_down.weight", (f, d), False)
        table[f"{i}.down.bias"] = (f"{b}ffn_down.bias", (d,), True)
    if c.kind == "idefics3":
        table["proj.weight"] = ("mm.model.fc.weight", (d * c.scale_factor**2, c.text_dim), False)
    else:  # y = x @ W: the file keeps Hugging Face's (D, T) matrix, T contiguous
        table["proj.weight"] = ("mm.input_projection.weight", (c.text_dim, d), False)
        table["proj.norm"] = ("mm.soft_emb_norm.weight", (d,), True)
    return table


def _tensor(name: str, by_name: dict[str, TensorInfo], theirs: str, shape: tuple[int, ...], vector: bool) -> TensorInfo:
    t = by_name.get(theirs)
    if t is None:
        raise ProjectorError(f"{name}: tensor {theirs!r} is missing")
    if t.shape != shape:
        raise ProjectorError(f"{name}: tensor {theirs!r} has shape {list(t.shape)}; the settings ask for {list(shape)}")
    allowed = VECTOR_TYPES if vector else MATRIX_TYPES
    if t.type_name not in allowed:
        raise ProjectorError(f"{name}: tensor {theirs!r} is {t.type_name}; webchat reads {', '.join(sorted(allowed))}")
    return t


def _int(name: str, meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise ProjectorError(f"{name}: key {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProjectorError(f"{name}: key {key!r} is {value!r}; expected an integer")
    return value


def _triple(name: str, meta: dict[str, Any], key: str) -> tuple[float, float, float]:
    value = meta.get(key)
    if not isinstance(value, list) or len(value) != 3 or not all(isinstance(x, float) for x in value):
        raise ProjectorError(f"{name}: key {key!r} is {value!r}; expected three floats")
    return (value[0], value[1], value[2])


__all__ = ["GGUFError", "ProjectorConfig", "ProjectorError", "ProjectorFile", "read_projector"]
