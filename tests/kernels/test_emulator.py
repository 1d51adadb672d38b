"""The CPU kernel emulator (kernels/cuda/emulator.py) itself: it finds the barrier bugs a GPU would hang on or hide, its
thread order exposes a missing barrier, the kernels give the same bits in either order, and its half conversion
rounds like torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from webchat.kernels.cuda.emulator import EmulatedKernelError, EmulatedModule, EmulatorUnavailable, emulated_launcher
from webchat.kernels.cuda.launch import KernelInputError, ptr
from webchat.kernels.cuda.ops import CudaOps


@pytest.fixture(scope="module")
def emulator() -> None:
    try:
        emulated_launcher()
    except EmulatorUnavailable as e:
        pytest.skip(f"the kernel emulator cannot run here: {e}")


def compile_kernels(label: str, body: str) -> EmulatedModule:
    from webchat.kernels.cuda.loader import GPU_DIR

    return EmulatedModule(label, (GPU_DIR / "common.cuh").read_text() + "\n" + body)


SOURCE = r"""
extern "C" __global__ void warp_sum_divergent(float* out) {
    float v = 1.0f;
    if ((threadIdx.x & 31) < 16) v = warp_sum(v);  // half the warp shuffles: a hang or garbage on a GPU
    out[threadIdx.x] = v;
}
extern "C" __global__ void block_sum_rows(const float* x, float* out, int dim) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += x[blockIdx.x * dim + i];
    s = block_sum(s);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}
extern "C" __global__ void syncthreads_divergent(float* out) {
    __shared__ float a[64];
    if (threadIdx.x < 32) {
        a[threadIdx.x] = 1.0f;
        __syncthreads();
    } else {
        a[threadIdx.x] = 2.0f;
        __syncthreads();  // a different barrier
    }
    out[threadIdx.x] = a[63 - threadIdx.x];
}
extern "C" __global__ void broadcast(float* out, int barrier) {
    __shared__ float x;
    if (threadIdx.x == 0) x = 42.0f + blockIdx.x;
    if (barrier) __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}
extern "C" __global__ void round_half(const float* x, unsigned short* bits, long n) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) bits[i] = from_float<half_t>(x[i]).bits;
}
"""


@pytest.fixture(scope="module")
def mod(emulator: None) -> EmulatedModule:
    return compile_kernels("selftest", SOURCE)


def test_finds_the_entry_points_and_their_parameters(mod: EmulatedModule) -> None:
    assert set(mod.kernels) == {"warp_sum_divergent", "block_sum_rows", "syncthreads_divergent", "broadcast",
                                "round_half"}  # fmt: skip
    assert [(p.c_type, p.name) for p in mod.kernels["block_sum_rows"]] == [
        ("const float*", "x"), ("float*", "out"), ("int", "dim")]  # fmt: skip


def test_block_sum_over_several_blocks(mod: EmulatedModule) -> None:
    x = torch.randn(3, 1000)
    out = torch.full((3,), float("nan"))
    mod.launch("block_sum_rows", (3, 1, 1), (256, 1, 1), (ptr(x), ptr(out), np.int32(1000)))
    torch.testing.assert_close(out, x.sum(1), rtol=1e-5, atol=1e-4)


def test_a_shuffle_with_half_the_warp_is_an_error_naming_the_warp(mod: EmulatedModule) -> None:
    out = torch.zeros(64)
    with pytest.raises(EmulatedKernelError, match=r"block \(0, 0, 0\) cannot finish.*warp 0: 16 at __shfl_xor_sync"):
        mod.launch("warp_sum_divergent", (1, 1, 1), (64, 1, 1), (ptr(out),))


def test_a_shuffle_in_a_partial_warp_is_an_error(mod: EmulatedModule) -> None:
    x, out = torch.ones(1, 48), torch.zeros(1)
    with pytest.raises(EmulatedKernelError, match=r"warp 1 of only 16 threads \(blockDim not a multiple of 32\)"):
        mod.launch("block_sum_rows", (1, 1, 1), (48, 1, 1), (ptr(x), ptr(out), np.int32(48)))


def test_threads_at_different_syncthreads_are_an_error(mod: EmulatedModule) -> None:
    out = torch.zeros(64)
    with pytest.raises(EmulatedKernelError, match=r"threads met at different __syncthreads calls"):
        mod.launch("syncthreads_divergent", (1, 1, 1), (64, 1, 1), (ptr(out),))


def test_reverse_order_exposes_a_missing_barrier(mod: EmulatedModule) -> None:
    def run(barrier: int, reverse: bool) -> torch.Tensor:
        out = torch.full((2, 64), float("nan"))
        mod.launch("broadcast", (2, 1, 1), (64, 1, 1), (ptr(out), np.int32(barrier)), reverse=reverse)
        return out

    want = torch.tensor([[42.0], [43.0]]).expand(2, 64)
    assert torch.equal(run(1, False), want) and torch.equal(run(1, True), want)
    assert not torch.equal(run(0, False), run(0, True))  # the race shows: some threads read x before thread 0 set it


def test_arguments_must_have_the_declared_types(mod: EmulatedModule) -> None:
    out = torch.zeros(3)
    with pytest.raises(KernelInputError, match=r"parameter 2 \(int dim\) needs int32, got int64"):
        mod.launch("block_sum_rows", (3, 1, 1), (32, 1, 1), (ptr(out), ptr(out), np.int64(1)))
    with pytest.raises(KernelInputError, match=r"block_sum_rows takes 3 arguments, got 2"):
        mod.launch("block_sum_rows", (3, 1, 1), (32, 1, 1), (ptr(out), ptr(out)))
    with pytest.raises(EmulatedKernelError, match=r"a block holds 1 to 1024 threads"):
        mod.launch("block_sum_rows", (3, 1, 1), (2048, 1, 1), (ptr(out), ptr(out), np.int32(1)))


def test_half_rounding_matches_torch(mod: EmulatedModule) -> None:
    # every rounding regime: subnormals, ties, the overflow edge, infinities, NaN
    special = torch.tensor([0.0, -0.0, 5.96e-8, 2.98e-8, 2.99e-8, 6.1e-5, 65504.0, 65519.99, 65520.0, 1e6,
                            float("inf"), -float("inf"), 1.0 + 2**-11, 1.0 + 3 * 2**-11, -2.5e-6])  # fmt: skip
    x = torch.cat([special, torch.randn(20000) * torch.logspace(-9, 5, 20000)])
    bits = torch.zeros(x.numel(), dtype=torch.int16)
    mod.launch("round_half", ((x.numel() + 255) // 256, 1, 1), (256, 1, 1), (ptr(x), ptr(bits), np.int64(x.numel())))
    assert torch.equal(bits.view(torch.float16), x.half())
    nan = torch.tensor([float("nan")])
    mod.launch("round_half", (1, 1, 1), (32, 1, 1), (ptr(nan), ptr(bits), np.int64(1)))
    assert bits[:1].view(torch.float16).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kernels_give_the_same_bits_in_either_thread_order(emulator: None, dtype: torch.dtype) -> None:
    # rms_norm shares data through __shared__ memory: a missing barrier would change the bits (paged attention's
    # twin is in test_paged_kernels)
    fwd, rev = (CudaOps("cpu", launcher=emulated_launcher(reverse=r), n_sm=132) for r in (False, True))
    torch.manual_seed(0)
    x, res, w = torch.randn(3, 1000).to(dtype), torch.randn(3, 1000).to(dtype), torch.randn(1000).to(dtype)
    for a, b in zip(fwd.add_rms_norm(x, res, w, 1e-5), rev.add_rms_norm(x, res, w, 1e-5), strict=True):
        assert torch.equal(a, b)
