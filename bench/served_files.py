"""The files `python -m bench.bench_served` runs beside the default model, and what it prints beside their tables.

Issue 38's set (`--set issue38`) is bench/make_bench_files.sh's output in $WEBCHAT_HOME/bench-files/: the 1.1B
Llama-shaped file in the four formats `llama-quantize` writes most (Q4_0, Q4_1, Q8_0, Q4_K_M) and a Llama-3.2-3B-shaped
Q4_K_M; `--set kquants` the 1.1B shape in Q5_K_M and Q6_K; `--set 8b` a Llama-3.1-8B-shaped Q4_K_M. For a file whose
decode is memory-bound, the weights a decoded token reads (the file's matrix bytes x tok/s) are printed beside the
machine's read bandwidth (bench/read_bandwidth.py); and whether the webchat checkout has issue 38's `--exact` is asked
of its `serve --help` before both precisions are started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT

SETS = {  # name -> (files in bench-files/, the clients the table has)
    "issue38": (["tinyllama-shape-q4_0.gguf", "tinyllama-shape-q4_1.gguf", "tinyllama-shape-q8_0.gguf",
                 "tinyllama-shape-q4_k_m.gguf", "llama32-3b-shape-q4_k_m.gguf"], "1,4"),
    # issue 65's: the 1.1B shape in the K-quants llama-quantize's users pick above Q4_K_M
    "kquants": (["tinyllama-shape-q5_k_m.gguf", "tinyllama-shape-q6_k.gguf"], "1,4"),
    # the size most people run on a laptop: Llama-3.1-8B's shape at Q4_K_M (WITH_8B=1 bash bench/make_bench_files.sh)
    "8b": (["llama31-8b-shape-q4_k_m.gguf"], "1,4"),
}
MEMORY_BOUND_BYTES = 1 << 30  # matrices past 1 GiB: the read bandwidth is measured beside the file's table


def bench_files_dir() -> Path:
    return Path(os.environ.get("WEBCHAT_HOME", Path.home() / ".cache" / "webchat")) / "bench-files"


def set_files(name: str) -> list[Path]:
    """The set's files, all present, or SystemExit naming the missing ones and the script that writes them."""
    files = [bench_files_dir() / f for f in SETS[name][0]]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise SystemExit(f"--set {name}: {', '.join(missing)} not in {bench_files_dir()}; write them with "
                         "`bash bench/make_bench_files.sh` (once, ~30 minutes on 2 cores)")
    return files


def matrix_bytes(gguf: Path) -> int:
    """Bytes of the weights one decoded token reads: every matrix but the embedding (a token reads one row of it),
    the embedding counted once as the head where the file has no output.weight (tied)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    total = sum(int(t.n_bytes) for name, t in tensors.items() if len(t.shape) == 2 and name != "token_embd.weight")
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        total += int(tensors["token_embd.weight"].n_bytes)
    return total


def read_bandwidth(threads: int) -> float:
    """GB/s of bench/read_bandwidth.py's read-only pass with `threads` threads (its own process: its 2 GiB buffer
    is gone before a server starts)."""
    out = subprocess.run([sys.executable, "-m", "bench.read_bandwidth", "--threads", str(threads)], cwd=ROOT,
                         check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["gbps"])


def has_exact_flag(src: Path) -> bool:
    """Whether `webchat serve` in the checkout `src` takes issue 38's `--exact` (float32 activations)."""
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, "-m", "webchat.cli", "serve", "--help"], cwd=src, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"`webchat serve --help` in {src} failed ({out.returncode}): {out.stderr[-500:]}")
    return "--exact" in out.stdout


def precision_of(info: dict[str, object]) -> str:
    """/api/info's `precision` ("exact" or "int8"), or what its absence means; then its CPU kernels where it names
    them ("int8, avx2 kernels without VNNI": what --isa avx2 asked for, as the server took it)."""
    value = info.get("precision")
    out = str(value) if value is not None else "not reported"
    kernels = info.get("cpu_kernels")
    if isinstance(kernels, dict):
        out += f", {kernels.get('path')} kernels {'with' if kernels.get('vnni') else 'without'} VNNI"
    return out


def weights_line(gguf: Path, decode: dict[str, float], gbps: float | None) -> str:
    """The weights a decoded token reads, per server at its single-client decode, beside the read bandwidth."""
    nbytes = matrix_bytes(gguf)
    per = ", ".join(f"{name} {nbytes * tps / 1e9:.1f} GB/s ({tps:.2f} tok/s)" for name, tps in decode.items())
    line = f"weights read a token: {nbytes / 1e9:.2f} GB of matrices; x single-client decode: {per}"
    if gbps is not None:
        line += f"; this machine's read bandwidth (bench/read_bandwidth.py, 2 threads): {gbps:.1f} GB/s"
    return line
