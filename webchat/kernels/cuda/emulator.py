"""Run the kernels/cuda/*.cu kernels on the CPU: a CudaOps launcher that compiles each module as host C++ (with
kernels/cuda/emulator.h) and runs every CUDA thread as a fiber, so the kernels' own indexing, reductions and barriers
are checked on machines without a GPU. `CudaOps("cpu", launcher=emulated_launcher())` then computes on CPU tensors
through the kernels.

It needs a C++17 compiler for x86-64 ($CXX, else g++ or c++); libraries are cached under $WEBCHAT_HOME/emulator by a
hash of the source, the header, the flags and the compiler. Slow (a few million thread switches a second) and not a
timing model: it is for correctness tests. `reverse=True` runs each block's threads in the opposite order, so a
kernel whose result depends on the order (a missing barrier) gives different answers under the two orders.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from webchat.files.home import webchat_home
from webchat.kernels.cuda import loader
from webchat.kernels.cuda.launch import KernelArg, KernelInputError, Launch, Launcher
from webchat.kernels.cuda.loader import KernelUnavailable

HEADER = loader.GPU_DIR / "emulator.h"
FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing", "-w")
_ENTRY = re.compile(r'extern\s+"C"\s+WEBCHAT_KERNEL\s+void\s+(\w+)\s*\(([^)]*)\)')
_C_TYPES: dict[str, tuple[type[np.generic], Any]] = {  # declared C type: (numpy scalar the launcher passes, ctypes)
    "int": (np.int32, ctypes.c_int32),
    "unsigned": (np.uint32, ctypes.c_uint32),
    "unsigned int": (np.uint32, ctypes.c_uint32),
    "long": (np.int64, ctypes.c_int64),
    "long long": (np.int64, ctypes.c_int64),
    "float": (np.float32, ctypes.c_float),
}


class EmulatorUnavailable(KernelUnavailable):
    """No C++ compiler, or not an x86-64 machine: the kernels cannot be emulated here."""


class EmulatedKernelError(RuntimeError):
    """An emulated launch failed: a barrier some threads never reached, an invalid launch shape."""


@dataclass(frozen=True)
class Param:
    c_type: str  # as declared after preprocessing, e.g. "const half_t*"
    name: str

    @property
    def is_pointer(self) -> bool:
        return self.c_type.endswith("*")


def compiler() -> str:
    """The C++ compiler to use, or EmulatorUnavailable saying what is missing."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise EmulatorUnavailable(f"the kernel emulator switches fibers with x86-64 code; this is {platform.machine()}")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise EmulatorUnavailable("the kernel emulator needs a C++17 compiler: set $CXX or install g++")
    return cxx


def _run(cmd: list[str], what: str) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise EmulatorUnavailable(f"{what} failed ({' '.join(cmd[:3])} ...):\n{res.stderr[-4000:]}")
    return res.stdout


@functools.cache
def _version(cxx: str) -> str:
    """The compiler's --version text (part of the library cache key), asked once per process."""
    return _run([cxx, "--version"], "asking the C++ compiler its version")


def entries(source: str, cxx: str) -> dict[str, list[Param]]:
    """The extern "C" __global__ entry points of a kernel source and their parameters, read from the preprocessed
    text (the entries are written through macros)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "scan.cpp"
        src.write_text(source)
        cmd = [cxx, "-std=c++17", "-E", "-P", "-DWEBCHAT_EMULATOR_SCAN", "-D__global__=WEBCHAT_KERNEL",
               "-include", str(HEADER), str(src)]  # fmt: skip
        text = _run(cmd, "preprocessing the kernel source")
    found: dict[str, list[Param]] = {}
    for m in _ENTRY.finditer(text):
        params = []
        for raw in (p.strip() for p in m.group(2).split(",") if p.strip()):
            pm = re.fullmatch(r"(.*?[\s*&])(\w+)", raw)
            if pm is None:
                raise EmulatorUnavailable(f"cannot read parameter {raw!r} of kernel {m.group(1)}")
            params.append(Param(re.sub(r"\s+", " ", pm.group(1).replace("__restrict__", "")).strip(), pm.group(2)))
        found[m.group(1)] = params
    return found


def _trampolines(kernels: dict[str, list[Param]]) -> str:
    out = ['extern "C" const char* webchat_emu_error() { return webchat_emu::sched().error.c_str(); }']
    for name, params in kernels.items():
        call = ", ".join(f"*reinterpret_cast<{p.c_type}*>(args[{i}])" for i, p in enumerate(params))
        out.append(f"static void webchat_emu_body_{name}(void* a) {{ void** args = static_cast<void**>(a); "
                   f"{name}({call}); }}")  # fmt: skip
        out.append(f'extern "C" int webchat_emu_launch_{name}(const unsigned* dims, void** args, int reverse) '
                   f"{{ return webchat_emu::launch(dims, &webchat_emu_body_{name}, args, reverse); }}")  # fmt: skip
    return "\n".join(out) + "\n"


def cache_dir() -> Path:
    return webchat_home() / "emulator"


class EmulatedModule:
    """One kernels/cuda/<name>.cu (or the given CUDA source) compiled for the host: its entries, their parameters, and
    the loaded library."""

    def __init__(self, name: str, source: str | None = None) -> None:
        cxx = compiler()
        source = loader.kernel_source(name) if source is None else source
        self.name = name
        self.kernels = entries(source, cxx)
        if not self.kernels:
            raise EmulatorUnavailable(f'kernels/cuda/{name}.cu declares no extern "C" __global__ kernels')
        full = source + "\n" + _trampolines(self.kernels)
        key = hashlib.sha256("\0".join([full, HEADER.read_text(), " ".join(FLAGS), _version(cxx)]).encode()).hexdigest()
        lib = cache_dir() / f"{name}-{key[:16]}.so"
        if not lib.is_file():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                src, out = Path(tmp) / f"{name}.cpp", Path(tmp) / lib.name
                src.write_text(full)
                _run([cxx, *FLAGS, "-include", str(HEADER), "-o", str(out), str(src)], f"compiling {name}.cu")
                os.replace(out, lib)  # atomic: a concurrent process sees the old state or a whole library
        self.lib = ctypes.CDLL(str(lib))
        self.lib.webchat_emu_error.restype = ctypes.c_char_p

    def launch(self, entry: str, grid: Sequence[int], block: Sequence[int], args: Sequence[KernelArg],
               reverse: bool = False) -> None:  # fmt: skip
        params = self.kernels.get(entry)
        if params is None:
            raise EmulatedKernelError(f"{self.name}.cu has no kernel {entry}; it has {sorted(self.kernels)}")
        if len(args) != len(params):
            raise KernelInputError(f"{entry} takes {len(params)} arguments, got {len(args)}")
        holders = [_c_value(entry, i, p, a) for i, (p, a) in enumerate(zip(params, args, strict=True))]
        argv = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
        dims = (ctypes.c_uint * 6)(*grid, *block)
        fn = getattr(self.lib, f"webchat_emu_launch_{entry}")
        if fn(dims, argv, int(reverse)) != 0:
            raise EmulatedKernelError(f"{entry}: {self.lib.webchat_emu_error().decode()}")


def _c_value(entry: str, i: int, p: Param, a: KernelArg) -> Any:
    """The ctypes value for parameter i, after checking the launcher passed the type the kernel declares."""
    want: type[np.generic]
    holder: Any
    if p.is_pointer:
        want, holder = np.uint64, ctypes.c_uint64
    elif p.c_type in _C_TYPES:
        want, holder = _C_TYPES[p.c_type]
    else:
        raise EmulatedKernelError(f"{entry} parameter {i} ({p.c_type} {p.name}): type not supported by the emulator")
    if type(a) is not want:
        raise KernelInputError(f"{entry} parameter {i} ({p.c_type} {p.name}) needs {want.__name__}, got "
                               f"{type(a).__name__}")  # fmt: skip
    return holder(a.item())


_modules: dict[str, EmulatedModule] = {}
_lock = threading.Lock()


def module(name: str) -> EmulatedModule:
    """kernels/cuda/<name>.cu compiled for the host (once per process; the library is cached on disk)."""
    with _lock:
        if name not in _modules:
            _modules[name] = EmulatedModule(name)
        return _modules[name]


def emulated_launcher(reverse: bool = False) -> Launcher:
    """A CudaOps/CudaSampler launcher that runs the kernels on CPU tensors (raw host pointers)."""
    compiler()  # fail now, naming what is missing

    def launch(plan: Launch, args: Sequence[KernelArg]) -> None:
        module(plan.module).launch(plan.entry, plan.grid, plan.block, args, reverse)

    return launch
