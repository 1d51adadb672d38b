"""Every kernels/cuda/*.cu compiles with nvcc for sm_80 and sm_90, as NVRTC will see it; CudaOps passes each kernel
exactly the parameters its PTX entry declares. Needs nvcc (on CI and the dev machines), not a GPU."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from webchat.engine.settings import SamplingSettings
from webchat.kernels.cuda import loader
from webchat.kernels.cuda.launch import Launch
from webchat.kernels.cuda.ops import CudaOps
from webchat.kernels.cuda.sampler import CudaSampler
from webchat.model.batch import make_batch

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: the CUDA compile checks did not run")
SOURCES = sorted(p.stem for p in loader.GPU_DIR.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")


def nvcc(args: list[str]) -> subprocess.CompletedProcess[str]:
    assert NVCC is not None
    return subprocess.run([NVCC, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PTX of every module for sm_80, compiled from the inlined source that CuPy hands NVRTC."""
    out: dict[str, str] = {}
    tmp = tmp_path_factory.mktemp("ptx")
    for name in SOURCES:
        src = tmp / f"{name}.cu"
        src.write_text(loader.kernel_source(name))
        res = nvcc(["-std=c++17", "-arch=sm_80", "--ptx", "-o", str(tmp / f"{name}.ptx"), str(src)])
        assert res.returncode == 0, f"nvcc --ptx {name}.cu failed:\n{res.stderr}"
        out[name] = (tmp / f"{name}.ptx").read_text()
    return out


def test_every_op_has_a_source() -> None:
    assert {"rms_norm", "rope", "silu_mul", "sampling", "kv_write",
            "paged_attention", "qgemv"} <= set(SOURCES)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", SOURCES)
def test_kernel_compiles(name: str, arch: str, tmp_path: Path) -> None:
    # the inlined source, with no include path: what NVRTC compiles at run time (warnings are errors)
    src = tmp_path / f"{name}.cu"
    src.write_text(loader.kernel_source(name))
    res = nvcc(["-std=c++17", f"-arch={arch}", "--cubin", "-Werror", "all-warnings", "-o", str(tmp_path / "k.cubin"),
                str(src)])  # fmt: skip
    assert res.returncode == 0, f"nvcc -arch={arch} {name}.cu failed:\n{res.stderr}"
    assert (tmp_path / "k.cubin").stat().st_size > 0


def broken_silu_mul() -> tuple[str, int]:
    """silu_mul's inlined source with an undefined name `nope` put in, and the line of silu_mul.cu it is on."""
    text = loader.kernel_source("silu_mul").replace("const float g = to_float(gate[i]);", "const float g = nope;")
    line = next(i for i, s in enumerate((loader.GPU_DIR / "silu_mul.cu").read_text().splitlines(), 1) if "gate[i]" in s)
    return text, line


def test_compile_errors_point_at_the_source_file(tmp_path: Path) -> None:
    src = tmp_path / "broken.cu"
    text, line = broken_silu_mul()
    src.write_text(text)
    res = nvcc(["-std=c++17", "-arch=sm_80", "--ptx", "-o", str(tmp_path / "b.ptx"), str(src)])
    assert res.returncode != 0
    assert f"silu_mul.cu({line})" in res.stderr, res.stderr


def ptx_params(ptx_text: str) -> dict[str, list[str]]:
    """entry name -> PTX parameter types, e.g. ['u64', 'u32', 'f32']."""
    entries: dict[str, list[str]] = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx_text):
        entries[m.group(1)] = re.findall(r"\.param\s+\.(\w+)", m.group(2))
    return entries


def arg_type(a: np.generic) -> str:
    kinds = {np.dtype(np.uint64): "u64", np.dtype(np.int64): "u64", np.dtype(np.int32): "u32",
             np.dtype(np.float32): "f32"}  # fmt: skip
    assert a.dtype in kinds, f"kernel argument {a!r} has dtype {a.dtype}; use uint64/int64/int32/float32"
    return kinds[a.dtype]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Launch, list[str]]] = []

    def __call__(self, plan: Launch, args: Sequence[np.generic]) -> None:
        self.calls.append((plan, [arg_type(a) for a in args]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_wrappers_pass_the_parameters_each_entry_declares(ptx: dict[str, str], dtype: torch.dtype) -> None:
    rec = Recorder()
    ops = CudaOps("cpu", launcher=rec, n_sm=8)  # CPU tensors: the launches are recorded, not run
    x = torch.zeros(3, 40, dtype=dtype)
    ops.rms_norm(x, torch.ones(40, dtype=dtype), 1e-5)
    ops.add_rms_norm(x, x.clone(), torch.ones(40, dtype=dtype), 1e-5)
    q, k = torch.zeros(2, 4, 16, dtype=dtype), torch.zeros(2, 2, 16, dtype=dtype)
    ops.rope(q, k, torch.zeros(2, 8), torch.zeros(2, 8))
    ops.silu_mul(x, x)
    pages = torch.zeros(6, 4, 2, 16, dtype=dtype)
    ops.kv_write(pages, pages.clone(), k, k.clone(), torch.tensor([5, 9]))
    ops.paged_attention(q, pages, pages.clone(), make_batch([([1], 2, [3], [-1]), ([1], 0, [1, 2], [-1])], 4))
    settings = SamplingSettings(repetition_penalty=1.2, token_bias={1: 2.0})
    CudaSampler(settings, 50, launcher=rec)._adjust_device(torch.zeros(50), [1, 2, 3])  # count + adjust
    assert len(rec.calls) == 9
    for plan, types in rec.calls:
        declared = ptx_params(ptx[plan.module])
        assert plan.entry in declared, f"{plan.entry} is not an entry of {plan.module}.cu: {sorted(declared)}"
        assert types == declared[plan.entry], (
            f"{plan.entry}: wrapper passes {types}, kernel takes {declared[plan.entry]}"
        )
