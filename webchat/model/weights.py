"""The --weights, --quantize and --exact choices, shared by the command lines and webchat.model.loader (no torch
import here)."""

from __future__ import annotations

import argparse

WEIGHTS = ("auto", "quantized", "float32")  # auto: the folder's quantized.safetensors on the CPU in float32
QUANTIZE = ("q8_0", "q4_1", "q4_0")  # matrices to this at load; the embedding and a tied head to q8_0
# what a quantized matrix's input is multiplied at: float32 ("exact"), 8-bit integers ("int8"), or 8-bit integers
# twice, the value and its rounding's residual, with a prompt's rows at float32 ("int8x2"); docs/quant.md
PRECISIONS = ("exact", "int8", "int8x2")


def add_weight_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", default="auto", choices=WEIGHTS,
                        help="auto (default): the model's quantized blocks on the CPU where the folder has them "
                             "(docs/quant.md); float32: the float weights; quantized: insist on the blocks")
    parser.add_argument("--quantize", default=None, choices=QUANTIZE,
                        help="quantize a float model's matrices at load (CPU)")
    add_precision_argument(parser)


def add_precision_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--exact", action="store_true",
                        help="multiply the quantized weights with float32 activations (within float rounding of the "
                             "float32 model on the same weights); default: whichever of that and int8 activations "
                             "runs faster for the file's formats on this CPU (docs/quant.md)")


def precision_of(args: argparse.Namespace) -> str | None:
    """load_model's precision for the parsed flags: "exact" with --exact, else None (the faster for the file)."""
    return "exact" if getattr(args, "exact", False) else None
