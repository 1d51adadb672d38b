"""Compile each kernels/cuda/<op>.cu once per process with CuPy (NVRTC) and hand out its kernels."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

GPU_DIR = Path(__file__).resolve().parent
OPTIONS = ("--std=c++17",)  # CuPy adds -arch=compute_XX (or sm_XX) of the current device itself
_INCLUDE = re.compile(r'^\s*#include\s+"([A-Za-z0-9_]+\.cuh)"\s*$')
_modules: dict[tuple[str, int], Any] = {}
_lock = threading.Lock()


class KernelUnavailable(RuntimeError):
    """CuPy or a CUDA device is missing, so the CUDA kernels cannot run here."""


def kernel_source(name: str) -> str:
    """kernels/cuda/<name>.cu with its local #include "x.cuh" lines inlined, each part led by #line so errors name the
    file.

    Inlining (instead of -I) keeps CuPy's on-disk cache honest: its key is the source text, which now covers headers.
    """
    path = GPU_DIR / f"{name}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {path}")
    return _expand(path, seen=set()) + "\n"


def _expand(path: Path, seen: set[Path]) -> str:
    out = [f'#line 1 "{path}"']
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE.match(line)
        if m is None:
            out.append("" if line.strip() == "#pragma once" else line)  # inlined once below; keeps line numbers
            continue
        header = GPU_DIR / m.group(1)
        if not header.is_file():
            raise FileNotFoundError(f"{path}:{lineno}: included header {header} does not exist")
        if header not in seen:  # every header here is #pragma once
            seen.add(header)
            out.append(_expand(header, seen))
        out.append(f'#line {lineno + 1} "{path}"')
    return "\n".join(out)


def cupy_module() -> Any:
    """Import CuPy, or raise KernelUnavailable saying how to get it."""
    try:
        import cupy
    except ImportError as e:  # also the path on every machine without the `cuda` extra
        raise KernelUnavailable(
            f"the CUDA kernels need CuPy ({install_hint()}), and importing it failed: {e}"
        ) from e
    return cupy


def install_hint() -> str:
    """How to install the CuPy that matches the CUDA major version torch was built with."""
    import torch

    major = (torch.version.cuda or "").split(".")[0]
    if major in ("12", "13"):
        return f"torch is built for CUDA {torch.version.cuda}: pip install 'webchat[cuda{major}]'"
    return f"pip install the cupy-cudaNNx wheel for your CUDA (torch reports CUDA {torch.version.cuda})"


def module(name: str) -> Any:
    """The compiled cupy.RawModule of kernels/cuda/<name>.cu for the current CUDA device (compiled on first use)."""
    cupy = cupy_module()
    device = int(cupy.cuda.runtime.getDevice())
    key = (name, device)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            mod = cupy.RawModule(code=kernel_source(name), options=OPTIONS)
            mod.compile()  # compile now, so errors surface here and never inside a CUDA graph capture
            _modules[key] = mod
        return mod


def function(name: str, entry: str) -> Any:
    """One extern "C" kernel of kernels/cuda/<name>.cu, e.g. function("rms_norm", "rms_norm_f16")."""
    return module(name).get_function(entry)
