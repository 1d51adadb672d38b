"""kernels/cuda/qgemv.cu against dequantize-then-matmul, on the GPU (CuPy) and everywhere on the CPU emulator."""

from __future__ import annotations

import pytest
import torch
from test_kernels import BACKENDS, backend_ops  # tests/ is on sys.path under pytest

from webchat.gguf.blocks import dequantize, quantize
from webchat.kernels.cuda.launch import KernelInputError
from webchat.kernels.cuda.ops import CudaOps
from webchat.kernels.cuda.qgemv import BLOCK_BYTES, plan_qgemv, qgemv

# float32 accumulation in another order, then one rounding to the output dtype
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float32: (2e-5, 2e-5)}


@pytest.fixture(scope="module", params=BACKENDS)
def ops(request: pytest.FixtureRequest) -> CudaOps:
    return backend_ops(request.param)


@pytest.mark.parametrize("qtype", list(BLOCK_BYTES))  # the formats qgemv.cu implements (no Q5 yet)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 5, 64), (2, 9, 96), (1, 33, 576)], ids=lambda s: "x".join(map(str, s)))
def test_qgemv_matches_dequantize_then_matmul(
    ops: CudaOps, qtype: str, dtype: torch.dtype, shape: tuple[int, int, int]
) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(n * k)
    wq = quantize(torch.randn(n, k, generator=gen), qtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    want = (x.double() @ dequantize(wq, qtype).double().T).to(dtype)
    got = qgemv(ops._launch, x.to(ops.device), wq.to(ops.device), qtype)
    torch.testing.assert_close(got.cpu(), want, rtol=TOL[dtype][0], atol=TOL[dtype][1] * k**0.5)


def test_qgemv_plan_checks_its_inputs() -> None:
    wq = quantize(torch.randn(8, 64), "q4_1")
    assert plan_qgemv(torch.zeros(1, 64), wq, "q4_1").grid == (2, 1, 1)
    with pytest.raises(KernelInputError, match="qtype must be one of q4_0, q4_1, q8_0, got 'q5_0'"):
        plan_qgemv(torch.zeros(1, 64), wq, "q5_0")
    with pytest.raises(KernelInputError, match=r"w must have shape \(\*, 68\), got \(8, 40\)"):
        plan_qgemv(torch.zeros(1, 64), wq, "q8_0")
    with pytest.raises(KernelInputError, match="K a multiple of 32"):
        plan_qgemv(torch.zeros(1, 48), wq, "q4_1")
