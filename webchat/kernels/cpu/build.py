"""Build (once, cached) and load webchat's C++ CPU kernels: quantized matmul and the forward (docs/quant.md).

Built with torch's C++ extension loader (g++ and ninja) so the kernels run on torch's own OpenMP thread pool through
`at::parallel_for`: one OpenMP runtime in the process, torch.set_num_threads governs both. `python -m
webchat.kernels.cpu.build` builds them ahead of time (scripts/setup.sh does).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from webchat.files.home import webchat_home

if TYPE_CHECKING:
    import torch

SOURCES = ("qmatmul.cpp", "qgemm.cpp", "qstep.cpp", "qops.cpp", "qkquant.cpp", "qsample.cpp", "qact.cpp", "qint8.cpp",
           "qint8k.cpp", "qgemm8.cpp", "qgemm8b.cpp", "qpack8.cpp", "qsuffix.cpp", "qgemm_amx.cpp", "vision.cpp",
           "vgemm.cpp", "qattn.cpp", "qattn_rows.cpp")
CSRC = Path(__file__).parent / "csrc"
PATHS = {"scalar": 0, "avx2": 1, "avx512": 2}  # WEBCHAT_QPATH forces one; default: the best this CPU runs
# -O3 without -march: the AVX2 and AVX-512 functions carry their own target attributes and are picked at run time
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-Wall"]
STALE_LOCK_S = 900  # a build takes 2-4 minutes on 2 cores


class StepHandle(Protocol):
    """A compiled forward (`Step` in csrc/qops.cpp) over the model's matrices (webchat.kernels.cpu.step.CpuStep)."""

    def forward(self, *args: Any) -> torch.Tensor: ...

    def forward_rows(self, *args: Any) -> torch.Tensor: ...

    def set_int8(self, on: bool, pack: bool = True) -> None: ...

    def set_precision(self, rows: int, prompt: int, pack: bool = True) -> None: ...


class VisionHandle(Protocol):
    """A compiled vision encoder (`VisionTower` in csrc/vision.cpp) over one projector's weights (webchat.vision)."""

    def forward(self, pixels: torch.Tensor) -> torch.Tensor: ...

    def tokens_per_tile(self) -> int: ...

    def amx_matrices(self) -> int: ...

    def phase_seconds(self) -> list[float]: ...


class QKernels(Protocol):
    """The compiled module (csrc/qops.cpp's bindings), typed once here: every caller holds this, never the bare
    extension handle."""

    def qmatmul(self, x: torch.Tensor, w: torch.Tensor, qtype: int, k: int, bias: torch.Tensor | None = None,
                gemm: bool = False, int8: bool = False, packed: bool = False, x2: bool = False,
                amx: bool = False) -> torch.Tensor: ...  # fmt: skip

    def repack8(self, w: torch.Tensor, qtype: int, pack: bool) -> None: ...

    def packs8(self, qtype: int, n: int) -> bool: ...

    def unpacked_rows(self, w: torch.Tensor, qtype: int, ids: torch.Tensor) -> torch.Tensor: ...

    def dequantize(self, w: torch.Tensor, qtype: int, k: int, ids: torch.Tensor | None = None) -> torch.Tensor: ...

    def set_path(self, path: int) -> int: ...

    def path(self) -> int: ...

    def best_path(self) -> int: ...

    def set_vnni(self, on: int) -> bool: ...

    def vnni(self) -> bool: ...

    def set_amx(self, on: int) -> bool: ...

    def amx(self) -> bool: ...

    def Step(self, *args: Any) -> StepHandle: ...  # noqa: N802 (the C++ class's name)

    def argmax_rows(self, x: torch.Tensor, ids: list[list[int]] = ...,
                    values: list[list[float]] = ...) -> list[int]: ...  # fmt: skip

    def describe_rows(self, x: torch.Tensor, rows: list[int], tokens: list[int],
                      ks: list[int]) -> list[tuple[float, int, list[tuple[int, float]]]]: ...  # fmt: skip

    def SuffixIndex(self, max_tokens: int, max_occurrences: int, max_match: int, min_share: float,  # noqa: N802
                    spec_offset: int, path: type) -> Any: ...  # fmt: skip

    def VisionTower(self, dims: list[int], eps: float, embed: list[torch.Tensor],  # noqa: N802
                    norms: list[torch.Tensor], mats: list[torch.Tensor], qtypes: list[int],
                    biases: list[torch.Tensor], amx: bool) -> VisionHandle: ...  # fmt: skip


class KernelsUnavailable(RuntimeError):
    """The C++ kernels could not be built or loaded here (no compiler, no ninja, a build error)."""


def build_name() -> str:
    """webchat_q_<hash of where the sources are, the flags and torch's version>: one folder per checkout, in which
    ninja rebuilds only what changed (torch's loader rechecks the sources on every load)."""
    import torch

    h = hashlib.sha256(f"{CSRC.resolve()} {torch.__version__} {' '.join(CFLAGS)}".encode())
    return f"webchat_q_{h.hexdigest()[:12]}"


def build_dir() -> Path:
    return webchat_home() / "build" / build_name()


def _missing_tool() -> str | None:
    scripts = sysconfig.get_path("scripts")  # the venv's bin: pip's ninja lives there even when PATH lacks it
    os.environ["PATH"] = os.pathsep.join([scripts, os.environ.get("PATH", "")])
    for tool in (os.environ.get("CXX", "c++"), "ninja"):
        if shutil.which(tool) is None:
            return tool
    return None


@functools.cache
def load(verbose: bool = False) -> QKernels:
    """The compiled module (qmatmul, dequantize, Step, set_path, path, best_path)."""
    from torch.utils import cpp_extension

    tool = _missing_tool()
    if tool is not None:
        raise KernelsUnavailable(f"{tool!r} not found on PATH; install a C++ compiler and ninja (scripts/setup.sh)")
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    lock = out / "lock"  # torch's build lock; a build killed mid-way leaves it behind and the next load waits forever
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    if not (out / f"{out.name}.so").is_file():
        print(f"webchat: building the C++ kernels into {out} (once; a few minutes)", file=sys.stderr, flush=True)
    try:
        mod = cpp_extension.load(
            name=out.name, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"], build_directory=str(out), verbose=verbose,
        )
    except (OSError, RuntimeError, ImportError) as exc:  # a compiler error, a failed link
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise KernelsUnavailable(f"building the C++ kernels in {out} failed: {last}") from exc
    apply_environment(mod)
    return cast(QKernels, mod)


def apply_environment(mod: Any) -> None:
    """What the environment forces on the module: WEBCHAT_QPATH a code path (scalar, avx2, avx512), WEBCHAT_VNNI=0
    or 1 the int8 kernels' vpdpbusd (with WEBCHAT_QPATH=avx2 and WEBCHAT_VNNI=0, the kernels a Zen 3 runs: the
    bench's AVX2 class on an AVX-512 machine), WEBCHAT_AMX=0 or 1 the exact prompt GEMM's AMX tiles (qgemm_amx.cpp).
    A wrong value is refused by name."""
    forced = os.environ.get("WEBCHAT_QPATH", "").strip()
    if forced:
        if forced not in PATHS:
            raise KernelsUnavailable(f"WEBCHAT_QPATH must be one of {', '.join(PATHS)}, got {forced!r}")
        mod.set_path(PATHS[forced])
    vnni = os.environ.get("WEBCHAT_VNNI", "").strip()
    if vnni:
        if vnni not in ("0", "1"):
            raise KernelsUnavailable(f"WEBCHAT_VNNI must be 0 or 1, got {vnni!r}")
        try:
            mod.set_vnni(int(vnni))
        except RuntimeError as exc:  # 1 on a CPU without AVX-VNNI or AVX-512 VNNI
            raise KernelsUnavailable(f"WEBCHAT_VNNI=1: {str(exc).splitlines()[0]}") from exc
    amx = os.environ.get("WEBCHAT_AMX", "").strip()
    if amx:
        if amx not in ("0", "1"):
            raise KernelsUnavailable(f"WEBCHAT_AMX must be 0 or 1, got {amx!r}")
        try:
            mod.set_amx(int(amx))
        except RuntimeError as exc:  # 1 on a CPU (or an OS) without AMX-BF16 tiles
            raise KernelsUnavailable(f"WEBCHAT_AMX=1: {str(exc).splitlines()[0]}") from exc


def try_load() -> QKernels | None:
    """The module, or None after one line on stderr saying why (callers then take the float path)."""
    try:
        return load()
    except KernelsUnavailable as exc:
        print(f"webchat: C++ kernels unavailable, using float32 PyTorch ops: {exc}", file=sys.stderr, flush=True)
        return None


def running() -> dict[str, object] | None:
    """The code path, vpdpbusd and the exact GEMM's AMX tiles the kernels run ({"path": "avx512", "vnni": true, "amx":
    false}), None where they are not loaded (the server's /api/info; a bench that forces the AVX2 class checks it
    took)."""
    if load.cache_info().currsize == 0:  # never loaded (or its build failed: nothing cached)
        return None
    mod = load()
    return {"path": path_name(mod), "vnni": bool(mod.vnni()), "amx": amx_tiles(mod)}


def amx_tiles(mod: QKernels) -> bool:
    """Whether the exact GEMM takes AMX tiles now: granted (mod.amx()) and on the AVX-512 path (qgemm_amx.cpp's
    amx_covers), not where a forced AVX2 path runs on the same CPU."""
    return bool(mod.amx()) and path_name(mod) == "avx512"


def path_name(mod: QKernels) -> str:
    """The name in PATHS of the code path the module runs now ("avx2")."""
    return next(name for name, p in PATHS.items() if p == int(mod.path()))


def available_paths() -> list[str]:
    """The code paths this CPU can run, scalar first (for tests that force each one)."""
    best = int(load().best_path())
    return [name for name, p in PATHS.items() if p <= best]


if __name__ == "__main__":
    mod = load(verbose="-v" in sys.argv)
    print(f"webchat kernels built in {build_dir()}; code path here: {path_name(mod)}")
