"""Each CUDA kernel against its PyTorch reference (webchat.model.ops.TorchOps) on fresh random inputs, outputs poisoned
beforehand (NaN, with NaN guards on either side), on the GPU and on any machine through the CPU emulator
(kernels/cuda/emulator.py); and, on any machine, the wrappers' input checks and launch geometry."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from webchat.engine.sampling import Choice, Sampler
from webchat.engine.settings import SamplingSettings
from webchat.kernels.cuda import CudaOps, KernelInputError, KernelUnavailable, kernel_source, launch
from webchat.kernels.cuda.emulator import EmulatorUnavailable, emulated_launcher
from webchat.kernels.cuda.loader import GPU_DIR
from webchat.kernels.cuda.sampler import CudaSampler, cuda_sampler, plan_adjust, plan_count
from webchat.model.ops import TorchOps

HAS_CUDA = torch.cuda.is_available()
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (rtol, atol): about two units in the last place of each dtype
ATTN_TOL = {torch.float16: (4e-3, 2e-3), torch.bfloat16: (3e-2, 1.6e-2), torch.float32: (1e-4, 2e-5)}
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float32: (1e-5, 1e-5)}
# where the kernels run: on the GPU through CuPy, and everywhere through the CPU emulator (kernels/cuda/emulator.py)
BACKENDS = [pytest.param("cuda", marks=pytest.mark.gpu), "emulated"]


def backend_ops(backend: str) -> CudaOps:
    if backend == "emulated":
        try:
            return CudaOps("cpu", launcher=emulated_launcher(), n_sm=132)  # H100's SM count: its split geometry
        except EmulatorUnavailable as e:
            pytest.skip(f"the kernel emulator cannot run here: {e}")
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    try:
        return CudaOps("cuda")
    except KernelUnavailable as e:
        pytest.skip(f"CUDA device present but the kernels cannot run: {e}")


@pytest.fixture(scope="module", params=BACKENDS)
def ops(request: pytest.FixtureRequest) -> CudaOps:
    return backend_ops(request.param)


@pytest.fixture(scope="module")
def cuda_ops() -> CudaOps:
    return backend_ops("cuda")


def rand(*shape: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """Random normal values (the same draws on any device), stored inside NaN guards: a read past either end
    turns an output into NaN, and a write there shows in guards_intact()."""
    t = poisoned(torch.empty(shape, dtype=dtype, device=device))
    return t.copy_(torch.randn(*shape, dtype=torch.float32) * scale)


GUARD = 64  # elements of NaN on either side of a poisoned() tensor


def poisoned(t: torch.Tensor) -> torch.Tensor:
    """A NaN tensor like t, viewed inside a larger NaN buffer."""
    buf = torch.full((t.numel() + 2 * GUARD,), float("nan"), dtype=t.dtype, device=t.device)
    return buf[GUARD : GUARD + t.numel()].view(t.shape)


def guards_intact(t: torch.Tensor) -> None:
    """t is a poisoned() view: nothing may have been written to the NaN on either side of it."""
    whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
    assert whole.numel() == t.numel() + 2 * GUARD, "not a poisoned() tensor"
    guards = torch.cat([whole[:GUARD], whole[-GUARD:]])
    assert guards.isnan().all(), f"{int((~guards.isnan()).sum())} elements written outside the tensor"


def close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> None:
    assert not actual.isnan().any(), f"{int(actual.isnan().sum())} of {actual.numel()} outputs unwritten (NaN)"
    guards_intact(actual)
    torch.testing.assert_close(actual, expected, rtol=tol[0], atol=tol[1])


# ---- on the GPU and in the emulator: kernel vs reference ----


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 4096), (2, 33), (5, 1000)])
def test_rms_norm_and_add_rms_norm(ops: CudaOps, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(shape[0] * 10_000 + shape[1])
    x, res, w = (
        rand(*shape, dtype=dtype, device=ops.device),
        rand(*shape, dtype=dtype, device=ops.device, scale=3.0),
        rand(shape[1], dtype=dtype, device=ops.device),
    )
    close(ops.rms_norm(x, w, 1e-5, out=poisoned(x)), TorchOps.rms_norm(x, w, 1e-5), TOL[dtype])
    y, r = ops.add_rms_norm(x, res, w, 1e-6, out=poisoned(x), residual_out=poisoned(x))
    y_ref, r_ref = TorchOps.add_rms_norm(x, res, w, 1e-6)
    close(r, r_ref, TOL[dtype])
    close(y, y_ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [(1, 9, 3, 64), (5, 4, 2, 16), (3, 32, 8, 128), (2, 6, 6, 80), (1, 3, 1, 2)])
def test_rope_in_place(ops: CudaOps, dtype: torch.dtype, dims: tuple[int, int, int, int]) -> None:
    t, n_heads, n_kv, hd = dims
    torch.manual_seed(sum(dims))
    q, k = rand(t, n_heads, hd, dtype=dtype, device=ops.device), rand(t, n_kv, hd, dtype=dtype, device=ops.device)
    angles = (torch.rand(t, hd // 2) * 100.0).to(ops.device)
    cos, sin = angles.cos(), angles.sin()
    q_ref, k_ref = TorchOps.rope(q.clone(), k.clone(), cos, sin)
    q_out, k_out = ops.rope(q, k, cos, sin)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    close(q, q_ref, TOL[dtype])
    close(k, k_ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (7, 128), (3, 14336), (1, 1), (5, 333)])
def test_silu_mul(ops: CudaOps, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(shape[1])
    gate, up = rand(*shape, dtype=dtype, device=ops.device, scale=4.0), rand(*shape, dtype=dtype, device=ops.device)
    close(ops.silu_mul(gate, up, out=poisoned(gate)), TorchOps.silu_mul(gate, up), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (7, 128), (3, 9216), (1, 1), (5, 333)])
def test_gelu_tanh_mul(ops: CudaOps, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """Gemma's MLP activation against F.gelu(approximate="tanh") * up, over both tails of the tanh."""
    torch.manual_seed(shape[1])
    gate, up = rand(*shape, dtype=dtype, device=ops.device, scale=4.0), rand(*shape, dtype=dtype, device=ops.device)
    got, want = ops.gelu_tanh_mul(gate, up, out=poisoned(gate)), TorchOps.gelu_tanh_mul(gate, up)
    close(got, want, TOL[dtype])
    assert not torch.allclose(got.float(), TorchOps.silu_mul(gate, up).float(), rtol=1e-2, atol=1e-2)


# ---- anywhere: input checks, launch geometry, sources ----


class Recorder:
    def __init__(self) -> None:
        self.launches: list[tuple[launch.Launch, Sequence[np.generic]]] = []

    def __call__(self, plan: launch.Launch, args: Sequence[np.generic]) -> None:
        self.launches.append((plan, args))


@pytest.fixture
def cpu_ops() -> tuple[CudaOps, Recorder]:
    rec = Recorder()
    return CudaOps("cpu", launcher=rec, n_sm=132), rec


def test_cuda_ops_without_a_device_or_cupy_says_why() -> None:
    if HAS_CUDA:
        pytest.skip("a CUDA device is present; this checks the refusal on machines without one")
    with pytest.raises(KernelUnavailable, match="CuPy|CUDA device"):
        CudaOps("cuda")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda o: o.rms_norm(torch.zeros(2, 8), torch.ones(8, dtype=torch.float16), 1e-5),
         r"w must have dtype torch.float32, got torch.float16"),
        (lambda o: o.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-5), r"w must have shape \(8\), got \(7,\)"),
        (lambda o: o.rms_norm(torch.zeros(8, 2).t(), torch.ones(8), 1e-5), r"x must be contiguous, got strides"),
        (lambda o: o.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-5),
         r"x must be float16, bfloat16 or float32, got torch.float64"),
        (lambda o: o.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5),
         r"residual must have shape \(2, 8\), got \(3, 8\)"),
        (lambda o: o.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-5, out=torch.zeros(2, 8, dtype=torch.float16)),
         r"out must have dtype torch.float32, got torch.float16"),
        (lambda o: o.rope(torch.zeros(2, 4, 16), torch.zeros(3, 2, 16), torch.zeros(2, 8), torch.zeros(2, 8)),
         r"k must have shape \(2, \*, 16\), got \(3, 2, 16\)"),
        (lambda o: o.rope(torch.zeros(2, 4, 16), torch.zeros(2, 2, 16), torch.zeros(2, 16), torch.zeros(2, 8)),
         r"cos must have shape \(2, 8\), got \(2, 16\)"),
        (lambda o: o.rope(torch.zeros(2, 4, 15), torch.zeros(2, 2, 15), torch.zeros(2, 7), torch.zeros(2, 7)),
         r"head_dim even, got \(2, 4, 15\)"),
        (lambda o: o.rope(torch.zeros(2, 4, 16), torch.zeros(2, 2, 16), torch.zeros(2, 8).double(), torch.zeros(2, 8)),
         r"cos must have dtype torch.float32, got torch.float64"),
        (lambda o: o.silu_mul(torch.zeros(3, 5), torch.zeros(3, 6)), r"up must have shape \(3, 5\), got \(3, 6\)"),
        (lambda o: o.silu_mul(torch.zeros(5, 3).t(), torch.zeros(3, 5)), r"gate must be contiguous"),
    ],
)  # fmt: skip
def test_wrappers_reject_bad_inputs_naming_expected_and_actual(
    cpu_ops: tuple[CudaOps, Recorder], call: object, message: str
) -> None:
    ops, rec = cpu_ops
    with pytest.raises(KernelInputError, match=message):
        call(ops)  # type: ignore[operator]
    assert rec.launches == []  # nothing launched on a rejected input


def test_wrappers_reject_tensors_on_another_device() -> None:
    ops = CudaOps("meta", launcher=Recorder(), n_sm=1)  # CPU tensors are then "on the wrong device"
    with pytest.raises(KernelInputError, match=r"x must be on meta, got cpu"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-5)


def test_launch_geometry_covers_every_element(cpu_ops: tuple[CudaOps, Recorder]) -> None:
    ops, rec = cpu_ops
    x = torch.zeros(5, 333)
    ops.rms_norm(x, torch.ones(333), 1e-5)
    ops.silu_mul(x, x)
    q, k = torch.zeros(3, 9, 64), torch.zeros(3, 3, 64)
    ops.rope(q, k, torch.zeros(3, 32), torch.zeros(3, 32))
    norm, silu, rope = (p for p, _ in rec.launches)
    assert norm.grid[0] == 5 and norm.block[0] % 32 == 0 and norm.block[0] <= 1024
    assert silu.grid[0] * silu.block[0] >= x.numel()
    assert rope.grid[0] * rope.block[0] >= 3 * (9 + 3) * 32


def test_split_counts_stay_within_bounds() -> None:
    assert all(1 <= launch.n_splits(n, r, 132) <= launch.MAX_SPLITS for n in (1, 17, 10**6) for r in (1, 9, 256))



def test_rms_norm_on_zero_rows_launches_nothing(cpu_ops: tuple[CudaOps, Recorder]) -> None:
    ops, rec = cpu_ops
    assert ops.rms_norm(torch.zeros(0, 8), torch.ones(8), 1e-5).shape == (0, 8)
    assert rec.launches == []


@pytest.mark.parametrize("name", sorted(p.stem for p in GPU_DIR.glob("*.cu")))
def test_kernel_source_maps_lines_back_to_the_files(name: str) -> None:
    src = kernel_source(name).splitlines()
    assert src[0] == f'#line 1 "{GPU_DIR / name}.cu"'
    assert "#include" not in "\n".join(src)
    files = {p.name: p.read_text().splitlines() for p in GPU_DIR.glob("*.cu*")}
    current, lineno = "", 0
    for line in src:  # every line after a #line directive is that line of that file
        if line.startswith("#line "):
            num, path = line.split(" ", 2)[1:]
            current, lineno = path.strip('"').rsplit("/", 1)[1], int(num)
            continue
        expected = files[current][lineno - 1]
        assert line == ("" if expected.strip() == "#pragma once" else expected), f"{current}:{lineno}"
        lineno += 1
    first = (GPU_DIR / f"{name}.cu").read_text().splitlines()[0]
    assert first.startswith("// ") and "=" in first, f"{name}.cu must open with a one-line formula, got {first!r}"


# ---- sampling: kernels/cuda/sampling.cu + webchat.kernels.cuda.sampler against webchat.engine.sampling ----

SAMPLING_CASES = [
    SamplingSettings(temperature=0.0),
    SamplingSettings(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),
    SamplingSettings(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0),
    SamplingSettings(temperature=1.3, top_k=0, top_p=1.0, min_p=0.1, typical_p=0.7),
    SamplingSettings(
        temperature=0.9,
        top_k=5,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.4,
        repetition_range=16,
        token_bias={7: 5.0, 9: -100.0},
    ),  # fmt: skip
    SamplingSettings(temperature=0.0, repetition_penalty=2.0, token_bias={3: 3.0}),
]


def sampled(choices: list[Choice]) -> list[tuple[object, ...]]:
    return [(c.token, c.prob, c.sampled_prob, c.rank, c.top) for c in choices]


@pytest.mark.parametrize("case", range(len(SAMPLING_CASES)))
def test_device_sampler_logic_equals_sampler_on_the_cpu(case: int) -> None:
    # CudaSampler's draw and description (device-independent torch code) against Sampler, same seed, same draws
    settings = dataclasses.replace(SAMPLING_CASES[case], seed=100 + case)
    gen = torch.Generator().manual_seed(case)
    ref, dev = Sampler(settings, 300), CudaSampler(settings, 300, launcher=None)
    history = [int(t) for t in torch.randint(0, 300, (40,), generator=gen)]
    got, want = [], []
    for step in range(30):
        logits = torch.randn(300, generator=gen) * 3.0
        alts = step % 4
        want.append(ref.sample(logits, history, top_alts=alts, want_probs=step % 2 == 0))
        got.append(dev.sample(logits, history, top_alts=alts, want_probs=step % 2 == 0))
        history.append(want[-1].token)
    assert [c.token for c in got] == [c.token for c in want]
    for g, w in zip(got, want, strict=True):
        assert (g.rank, [t for t, _ in g.top]) == (w.rank, [t for t, _ in w.top])
        assert g.prob == pytest.approx(w.prob, rel=1e-6) if w.prob is not None else g.prob is None
        assert g.sampled_prob == pytest.approx(w.sampled_prob, rel=1e-6) if w.sampled_prob else g.sampled_prob is None


def test_sampler_kernel_plans_check_their_inputs() -> None:
    with pytest.raises(KernelInputError, match=r"logits must have dtype torch.float32, got torch.float16"):
        plan_adjust(torch.zeros(10, dtype=torch.float16), None, None)
    with pytest.raises(KernelInputError, match=r"counts must have shape \(10\), got \(9,\)"):
        plan_adjust(torch.zeros(10), None, torch.zeros(9))
    with pytest.raises(KernelInputError, match=r"ids must have dtype torch.int32, got torch.int64"):
        plan_count(torch.zeros(4, dtype=torch.long), torch.zeros(10))
    with pytest.raises(KernelInputError, match=r"logits must hold 10 values, got shape \(11,\)"):
        CudaSampler(SamplingSettings(), 10).sample(torch.zeros(11), [])
    assert type(cuda_sampler(SamplingSettings(), 10, "cpu")) is Sampler


@pytest.mark.parametrize("case", range(len(SAMPLING_CASES)))
def test_sampling_kernels_against_sampler(ops: CudaOps, case: int) -> None:
    settings = dataclasses.replace(SAMPLING_CASES[case], seed=7 + case)
    if ops.device.type == "cuda":
        sampler = cuda_sampler(settings, 5000, "cuda")
        assert isinstance(sampler, CudaSampler)
    else:
        sampler = CudaSampler(settings, 5000, launcher=ops._launch)
    ref = Sampler(settings, 5000)
    gen = torch.Generator().manual_seed(case)
    history = [int(t) for t in torch.randint(0, 5000, (200,), generator=gen)]
    logits = torch.randn(5000, generator=gen) * 4.0
    adjusted = sampler._adjust_device(logits.to(ops.device), history).cpu()
    torch.testing.assert_close(adjusted, ref._adjust(logits, history), rtol=1e-6, atol=1e-6)
    same = 0
    for _ in range(40):
        logits = torch.randn(5000, generator=gen) * 4.0
        got = sampler.sample(logits.to(ops.device), history, top_alts=5, want_probs=True)
        want = ref.sample(logits, history, top_alts=5, want_probs=True)
        same += got.token == want.token
        assert got.prob == pytest.approx(want.prob, rel=1e-4, abs=1e-7)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        history.append(want.token)
    assert same >= 39  # the same uniforms; a float32 tie at a truncation boundary may flip one draw


class ScalarReads(TorchDispatchMode):
    """Counts tensor-to-Python-scalar reads (aten._local_scalar_dense: item(), float(t), indexing with a 0-d tensor),
    each a host sync on a GPU; the seeded uniforms (aten.rand on the CPU generator) are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.uniforms: set[int] = set()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.rand:
            self.uniforms.add(id(out))
        elif func is torch.ops.aten._local_scalar_dense.default and id(args[0]) not in self.uniforms:
            self.reads.append(f"{tuple(args[0].shape)} {args[0].dtype}")
        return out


@pytest.mark.parametrize("case", range(len(SAMPLING_CASES)))
def test_device_sampler_reads_no_scalar_before_its_one_copy(case: int) -> None:
    # the GPU path (kernels emulated here) must not sync mid-step: its only host read is the packed .tolist()
    try:
        launcher = emulated_launcher()
    except EmulatorUnavailable as e:
        pytest.skip(f"the kernel emulator cannot run here: {e}")
    settings = dataclasses.replace(SAMPLING_CASES[case], seed=case)
    sampler = CudaSampler(settings, 300, launcher=launcher)
    gen = torch.Generator().manual_seed(case)
    logits = torch.randn(4, 300, generator=gen) * 3.0
    with ScalarReads() as mode:
        for row in logits:
            sampler.sample(row, [5, 6, 7, 5], top_alts=3, want_probs=True)
    assert mode.reads == []


@pytest.mark.gpu
def test_device_sampling_syncs_once_per_token(cuda_ops: CudaOps) -> None:
    settings = dataclasses.replace(SAMPLING_CASES[4], seed=3)
    sampler = cuda_sampler(settings, 32000, "cuda")
    logits = torch.randn(6, 32000, device="cuda") * 3
    sampler.sample(logits[0], [1, 2, 3], top_alts=5, want_probs=True)  # warm-up: compiles, allocates
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for row in logits[1:]:
                sampler.sample(row, [1, 2, 3], top_alts=5, want_probs=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in seen if "synchroniz" in str(w.message)]
    assert len(syncs) == 5, syncs  # the .tolist() of each token's packed result


@pytest.mark.gpu
def test_seeded_device_sampling_is_reproducible(cuda_ops: CudaOps) -> None:
    settings = SamplingSettings(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=99)
    logits = torch.randn(20, 32000, device="cuda") * 3
    runs = [[cuda_sampler(settings, 32000, "cuda").sample(row, []).token for row in logits] for _ in range(2)]
    assert runs[0] == runs[1]
