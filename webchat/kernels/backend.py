"""A model folder loaded onto its device with the fastest backend this machine runs: on the CPU the C++ kernels
(webchat.kernels.cpu: the quantized blocks, the whole forward as one call, the sampler's scans, the suffix index)
and the faster precision for the model's formats; on CUDA the CuPy kernels and CUDA graphs.

    model = load_model(path, device="cpu", weights="auto", quantize=None, precision=None)

Precision: what the quantized matrices multiply at, "exact" (float32 activations) or "int8"; None takes the faster
for the model's formats on this CPU (webchat.model.precision).
"""

from __future__ import annotations

from pathlib import Path

import torch

from webchat.kernels.cpu import build as qkernels
from webchat.model.loader import quantized_weights, read_model
from webchat.model.precision import default_precision, quantized_formats, set_precision
from webchat.model.transformer import Transformer
from webchat.model.weights import PRECISIONS


def load_model(
    path: Path | str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    weights: str = "auto", quantize: str | None = None, precision: str | None = None,
) -> Transformer:
    """The folder's model (webchat.model.loader.read_model) with its backend installed and its precision set."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    path, device = Path(path), torch.device(device)
    quantized_weights(path, device, dtype, weights, quantize)  # the settings checked before anything is read
    kernels = qkernels.try_load() if device.type == "cpu" else None
    model = read_model(path, device, dtype, weights, quantize, kernels)
    if device.type == "cuda":  # CudaOps kernels and CUDA graphs where CuPy is installed (webchat.kernels.cuda.graphs)
        from webchat.kernels.cuda.graphs import enable_cuda_backend

        enable_cuda_backend(model)
    else:  # the forward of up to 64 tokens as one C++ call (webchat.kernels.cpu.step), quantized or float32 matrices
        from webchat.kernels.cpu.step import enable_cpu_step

        enable_cpu_step(model, kernels)
        model.row_scan = kernels  # the sampler's argmax and heatmap numbers in C++ (webchat.engine.sampling.RowScan)
        model.suffix_index = None if kernels is None else kernels.SuffixIndex  # the auto planner's index in C++
    if precision is None:
        here = qkernels.path_name(kernels) if kernels is not None else "none"
        precision = default_precision(quantized_formats(model), here)
    set_precision(model, precision, kernels)
    return model
