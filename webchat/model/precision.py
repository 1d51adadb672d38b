"""What a quantized model's matmuls multiply at (docs/quant.md, "Precisions"): "exact" (float32 activations, within
float rounding of the float32 model on the same weights), "int8" (each matrix input row quantized to 8 bits once,
integer dot products) or "int8x2" (each row as two 8-bit rows, the value and its rounding's residual: about 15 bits,
the exact path's greedy text at about int8's speed), and which a model runs by default."""

from __future__ import annotations

from collections.abc import Collection, Iterable
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
# int8x2 (the exact path's greedy text, docs/quant.md "Which precision runs") where a model's quantized matrices hold
# at most this many weights: SmolLM2-135M's 135M (its decode 1.06x / 1.34x int8's time at 1 / 4 sequences, one
# thread, still several times llama-server's speed); the 1.1B files (1.14x / 1.51x) keep int8, whose served speed
# issue 64 holds to within 5%
INT8X2_MAX_WEIGHTS = 500_000_000
QTYPE_IDS = {name: spec[0] for name, spec in {**QTYPES, **K_QTYPES}.items()}


class QuantFormats(frozenset[str]):
    """The formats of a model's quantized matrices, and how many weights those matrices hold."""

    weights: int

    def __new__(cls, names: Iterable[str], weights: int) -> QuantFormats:
        self = super().__new__(cls, names)
        self.weights = weights
        return self


def default_precision(qtypes: Collection[str], path: str) -> str:
    """The precision a model runs unless asked: "exact" where there is no quantized matrix (float weights have no int8
    path) or no vector path; "int8x2" for a model of at most INT8X2_MAX_WEIGHTS quantized weights (qtypes a
    QuantFormats: a bare set of names says nothing of size); "int8" otherwise."""
    if not qtypes or path not in INT8_FASTER_ON:
        return "exact"
    if isinstance(qtypes, QuantFormats) and qtypes.weights <= INT8X2_MAX_WEIGHTS:
        return "int8x2"
    return "int8"


def set_precision(model: Transformer, precision: str, kernels: BlockKernels | None, pack: bool = True) -> str:
    """Make the model's quantized matrices multiply at `precision` (the C++ forward and the PyTorch path alike);
    returns it. "int8" or "int8x2" on a model without quantized matrices or without the kernels is an error naming
    why. With either, the matrices whose format has a packed form (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) are packed in
    place unless `pack` is False (the bench's comparison); "exact" unpacks them. A tied head packs with the
    embedding's table, whose lookup then gathers each row back (QEmbedding.packed)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    linears = [m for m in model.modules() if isinstance(m, QLinear)]
    if precision != "exact" and (not linears or kernels is None):
        why = "the C++ kernels could not be built" if kernels is None else "the model has no quantized matrices"
        raise ValueError(f"{precision} activations need quantized matrices and the C++ kernels: {why}")
    embedding = model.tok_embeddings
    table = getattr(embedding, "weight", None)
    for m in linears:
        m.int8, m.x2 = precision != "exact", precision == "int8x2"
        _pack(m, m.int8 and pack, kernels)
        if isinstance(embedding, QEmbedding) and table is not None and m.weight.data_ptr() == table.data_ptr():
            embedding.packed = m.packed  # a tied head: the embedding's lookup reads the layout the head has
    set_on_runner = getattr(model.runner, "set_precision", None)  # webchat.kernels.cpu.step.CpuStep
    if set_on_runner is not None:
        set_on_runner(precision, pack)
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


def quantized_formats(model: nn.Module) -> QuantFormats:
    """The formats of the model's quantized matrices and their weights (the embedding's lookup is exact either way; a
    tied head counts once, as the head)."""
    linears = [m for m in model.modules() if isinstance(m, QLinear)]
    return QuantFormats({m.qtype for m in linears}, sum(m.in_features * m.out_features for m in linears))
