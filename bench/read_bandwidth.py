"""The machine's read bandwidth, STREAM-like: a read-only sum over a float32 buffer far larger than any cache, with
the threads the servers get; the best of `--repeat` passes, in GB/s (10^9 bytes). bench.bench_served runs it
beside a memory-bound model's decode, whose weights read a token (matrix bytes x tok/s) it is the ceiling of.

    .venv/bin/python -m bench.read_bandwidth [--gib 2] [--threads 2] [--repeat 5]    # prints one JSON line

torch's sum splits the buffer over its threads, each summing its part in vector registers (AVX2: 8 floats an add),
so the pass is bound by the loads, not the adds: the same shape as STREAM's read-only kernels, without the stores.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def read_gbps(gib: float, threads: int, repeat: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    n = int(gib * (1 << 30)) // 4
    buf = torch.ones(n, dtype=torch.float32)  # every page touched once, so no pass faults pages in
    buf.sum()  # warm-up
    best = float("inf")
    total = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        total = float(buf.sum())
        best = min(best, time.perf_counter() - t0)
    if abs(total - n) > n * 1e-3:  # the sum read every value
        raise RuntimeError(f"read pass summed {total}, expected {n}: not every value was read")
    return {"gbps": buf.numel() * 4 / best / 1e9, "threads": threads, "gib": gib, "best_s": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="buffer size in GiB (default 2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(read_gbps(args.gib, args.threads, args.repeat)))


if __name__ == "__main__":
    main()
