"""Every kernels/cuda/*.cu compiles with NVRTC, the compiler CuPy calls at run time, from the exact text
kernels/cuda/loader.py hands it and with its options: unlike nvcc, NVRTC includes no CUDA headers. Needs libnvrtc (the
nvidia-cuda-nvrtc wheel of the test extra, or a CUDA toolkit's), not a GPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
from pathlib import Path

import pytest
from test_nvcc import SOURCES, broken_silu_mul  # tests/ is on sys.path under pytest

from webchat.kernels.cuda import loader


def find_nvrtc() -> ctypes.CDLL | None:
    candidates: list[str] = []
    spec = importlib.util.find_spec("nvidia")  # the namespace package of NVIDIA's wheels
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += [str(p) for p in sorted(Path(root).glob("*/lib/libnvrtc.so*")) if "builtins" not in p.name]
    system = ctypes.util.find_library("nvrtc")
    candidates += [system] if system else []
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


NVRTC = find_nvrtc()
pytestmark = pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found (pip install nvidia-cuda-nvrtc)")


def nvrtc_compile(source: str, name: str, arch: str) -> tuple[int, str]:
    """(nvrtcResult, log) of compiling source with the loader's options for a virtual arch such as compute_90."""
    assert NVRTC is not None
    prog = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None) == 0
    try:
        opts = [o.encode() for o in (*loader.OPTIONS, f"-arch={arch}")]
        rc = NVRTC.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetProgramLog(prog, log)
        return int(rc), log.value.decode(errors="replace")
    finally:
        NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("name", SOURCES)
def test_kernel_compiles_with_nvrtc(name: str, arch: str) -> None:
    rc, log = nvrtc_compile(loader.kernel_source(name), name, arch)
    assert rc == 0, f"NVRTC failed on {name}.cu for {arch}:\n{log}"
    assert "warning" not in log, f"NVRTC warns on {name}.cu for {arch}:\n{log}"


def test_nvrtc_errors_point_at_the_source_file() -> None:
    text, line = broken_silu_mul()
    rc, log = nvrtc_compile(text, "silu_mul", "compute_80")
    assert rc != 0
    assert f"silu_mul.cu({line}): error" in log and "nope" in log, log
