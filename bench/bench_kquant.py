"""One decode matvec (x of 1 row) per weight format on the CPU: Q4_K and Q6_K (kernels/cpu/csrc/qkquant.cpp) against
Q4_1 and Q8_0 (the C++ qmatmul the default model runs) and float32 torch, same matrix, same run, 2 threads.

Prints the median of `--repeats` timed calls per format and its ratio to float32. Q4_K and Q6_K twice: `op` is
torch.ops.webchat_kq.matmul (the PyTorch path's QLinear), `step` the rows the C++ forward runs (qmatmul_multi →
kq_rows, through the `qmatmul` binding). The K-quant blocks come from the test
encoder (tests/kquant_encode.py); speed does not depend on the values.
Run: `.venv/bin/python bench/bench_kquant.py`
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kquant_encode import encode_q4_k, encode_q6_k  # noqa: E402
from webchat.kernels.cpu import build as qkernels  # noqa: E402
from webchat.model.quant import quantize  # noqa: E402

SHAPES = [(1536, 576), (576, 1536), (4096, 4096), (11008, 4096)]  # (N, K): SmolLM2-135M MLP, Llama-7B layers


def median_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_shape(kernels: Any, n: int, k: int, repeats: int) -> str:
    w = torch.randn(n, k) * 0.05
    x = torch.randn(1, k)
    runs: dict[str, Callable[[], torch.Tensor]] = {"float32": lambda: F.linear(x, w)}
    for name, qt in (("q4_1", 3), ("q8_0", 8)):
        blocks = quantize(w, name)
        runs[name] = lambda b=blocks, q=qt: kernels.qmatmul(x, b, q, k, None)
    if k % 256 == 0:
        for name, qt, enc in (("q4_k", 12, encode_q4_k), ("q6_k", 14, encode_q6_k)):
            blocks = torch.from_numpy(enc(w.numpy()))
            runs[f"{name} op"] = lambda b=blocks, q=qt: torch.ops.webchat_kq.matmul(x, b, q, k, None)
            runs[f"{name} step"] = lambda b=blocks, q=qt: kernels.qmatmul(x, b, q, k, None)
    times = {name: median_ms(fn, repeats) for name, fn in runs.items()}
    cells = [f"{name} {ms:.3f} ({ms / times['float32']:.2f}x)" for name, ms in times.items()]
    return f"{n}x{k}: " + ", ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = qkernels.load()
    print(f"threads {args.threads}, median of {args.repeats}; ms per call (ratio to float32)")
    for n, k in SHAPES:
        print(bench_shape(kernels, n, k, args.repeats))


if __name__ == "__main__":
    main()
