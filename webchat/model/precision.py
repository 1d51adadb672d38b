"""What a quantized model's matmuls multiply at (docs/quant.md, "Two precisions"): "exact" (float32 activations,
within float rounding of the float32 model on the same weights) or "int8" (each matrix input row quantized to 8 bits
once, integer dot products), and which of the two a model runs by default."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from torch import nn

from webchat.gguf.blocks import K_QTYPES, QTYPES
from webchat.model.quant import BlockKernels, QEmbedding, QLinear
from webchat.model.weights import PRECISIONS

if TYPE_CHECKING:
    from webchat.model.transformer import Transformer

# the code paths on which int8 activations run faster than float32 for every format they cover (docs/quant.md: the
# measurements); on the scalar path neither has vector arithmetic and the float kernels stay the default
INT8_FASTER_ON = ("avx2", "avx512")
QTYPE_IDS = {name: spec[0] for name, spec in {**QTYPES, **K_QTYPES}.items()}


def default_precision(qtypes: Collection[str], path: str) -> str:
    """The faster precision for matrices of these formats on this code path: "exact" where there is no quantized
    matrix (float weights have no int8 path) or no vector path."""
    if not qtypes or path not in INT8_FASTER_ON:
        return "exact"
    return "int8"


def set_precision(model: Transformer, precision: str, kernels: BlockKernels | None, pack: bool = True) -> str:
    """Make the model's quantized matrices multiply at `precision` (the C++ forward and the PyTorch path alike);
    returns it. "int8" on a model without quantized matrices or without the kernels is an error naming why. With int8,
    the matrices whose format has a packed form (Q4_0, Q4_1, Q8_0, Q4_K) are packed in place unless `pack` is False
    (the bench's comparison); "exact" unpacks them. A tied head packs with the embedding's table, whose lookup then
    gathers each row back (QEmbedding.packed)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    linears = [m for m in model.modules() if isinstance(m, QLinear)]
    if precision == "int8" and (not linears or kernels is None):
        why = "the C++ kernels could not be built" if kernels is None else "the model has no quantized matrices"
        raise ValueError(f"int8 activations need quantized matrices and the C++ kernels: {why}")
    embedding = model.tok_embeddings
    table = getattr(embedding, "weight", None)
    for m in linears:
        m.int8 = precision == "int8"
        _pack(m, m.int8 and pack, kernels)
        if isinstance(embedding, QEmbedding) and table is not None and m.weight.data_ptr() == table.data_ptr():
            embedding.packed = m.packed  # a tied head: the embedding's lookup reads the layout the head has
    set_int8 = getattr(model.runner, "set_int8", None)  # webchat.kernels.cpu.step.CpuStep
    if set_int8 is not None:
        set_int8(precision == "int8", pack)
    model.precision = precision
    return precision


def _pack(m: QLinear, on: bool, kernels: BlockKernels | None) -> None:
    """m's rows packed 8 to a group (on: where its format has the form) or back in ggml's layout, in place
    (kernels/cpu/csrc/qpack8.cpp: the int8 kernels read the packed form, everything else the file's)."""
    if on == m.packed or kernels is None:
        return
    qt = QTYPE_IDS[m.qtype]
    if on and not kernels.packs8(qt, m.out_features):
        return
    kernels.repack8(m.weight.data, qt, on)
    m.packed = on


def quantized_formats(model: nn.Module) -> set[str]:
    """The formats of the model's quantized matrices (the embedding's lookup is exact either way)."""
    return {m.qtype for m in model.modules() if isinstance(m, QLinear)}
