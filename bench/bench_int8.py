"""int8 against float32 activations (docs/quant.md, "Two precisions"), in one process on one loaded model, the two
precisions alternating (A, B, A, B, ...) so a shared machine's load falls on both alike:

  matrices  one matrix of each format the model holds, one thread, CPU time (min of 5): 1 and 4 rows of x through
            the row kernels, 256 prompt rows (the GEMM); int8 on the file's rows and, where the format has the form,
            on rows packed 8 to a group (qpack8.cpp: what int8 runs)
  forward   the bare C++ forward: a decode step of 1 and 4 sequences at position 300, and a ~1,000-token prompt fed
            in the engine's 256-token chunks (wall time, the machine's threads); int8 packed (the default), int8 on
            the file's rows (int8-rows) and exact

    .venv/bin/python -m bench.bench_int8 --model ~/.cache/webchat/bench-files/tinyllama-shape-q4_k_m.gguf
    .venv/bin/python -m bench.bench_int8 --only matrices          # the default model
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from bench.common import default_model, table_header, table_row
from webchat.gguf.blocks import K_QTYPES, QTYPES
from webchat.kernels.backend import load_model
from webchat.kernels.cpu import build
from webchat.model.batch import make_batch
from webchat.model.kv_cache import PageTable
from webchat.model.precision import QTYPE_IDS, set_precision
from webchat.model.quant import QLinear
from webchat.model.transformer import Transformer

PAGE = 16
# name: (precision, pack)
PRECISIONS = {"exact": ("exact", False), "int8": ("int8", True), "int8-rows": ("int8", False)}


def cpu_ms(fn: Callable[[], object], reps: int) -> float:
    """min over 5 batches of CPU time a call, ms (this thread's)."""
    best = []
    for _ in range(5):
        t = time.thread_time()
        for _ in range(reps):
            fn()
        best.append((time.thread_time() - t) / reps)
    return min(best) * 1000


def matrices(model: Transformer) -> None:
    """One matrix of each format: exact rows / int8 rows (1 and 4 rows of x), exact / int8 prompt GEMM (256 rows)."""
    kernels, threads = build.load(), torch.get_num_threads()
    torch.set_num_threads(1)
    seen: dict[str, QLinear] = {}
    for m in model.modules():
        if isinstance(m, QLinear) and m.qtype not in seen:
            seen[m.qtype] = m
    print(table_header("matrix", "rows", "exact ms", "int8 ms", "packed ms", "int8 GMAC/s"))
    for qtype, lin in sorted(seen.items()):
        qt, k, n = {**QTYPES, **K_QTYPES}[qtype][0], lin.in_features, lin.out_features
        w = lin.weight.detach().clone()
        if lin.packed:  # the model's copy is packed: the file's rows for the first two columns
            kernels.repack8(w, qt, False)
        packed = None
        if kernels.packs8(qt, n):
            packed = w.clone()
            kernels.repack8(packed, qt, True)
        for rows, gemm in ((1, False), (4, False), (256, True)):
            x = torch.randn(rows, k)
            reps = max(2, int(3e7 / (rows * n * k)))
            times = [cpu_ms(partial(kernels.qmatmul, x, w, qt, k, None, gemm, int8), reps) for int8 in (False, True)]
            if packed is not None:
                times.append(cpu_ms(partial(kernels.qmatmul, x, packed, qt, k, None, gemm, True, True), reps))
            cells = [f"{t:.3f}" for t in times] + ["-"] * (3 - len(times))
            print(table_row(f"{n}x{k} {qtype}", rows, *cells, f"{rows * n * k / min(times[1:]) / 1e6:.1f}"), flush=True)
    torch.set_num_threads(threads)


def forward(model: Transformer, reps: int, prompt: int) -> None:
    kernels = build.load()
    pool = model.new_pool(4 * 400 + prompt + 64, PAGE)
    tables = [PageTable(pool) for _ in range(4)]
    for t in tables:
        t.ensure(400)
    set_precision(model, "exact", kernels)
    names = [p for p, (_, pack) in PRECISIONS.items() if not pack or any(
        kernels.packs8(QTYPE_IDS[m.qtype], m.out_features) for m in model.modules() if isinstance(m, QLinear))]
    for t in tables:  # 300 positions of context each
        for s in range(0, 300, 64):
            model(make_batch([(list(range(100 + s, 164 + s)), s, t.pages, [-1])], PAGE, prompt_ends=[300]), pool)
    for rows in (1, 4):
        batch = make_batch([([5], 300, tables[i].pages, [-1]) for i in range(rows)], PAGE, prompt_ends=[300] * rows)
        times: dict[str, list[float]] = {p: [] for p in names}
        for _ in range(reps):
            for p in names:
                set_precision(model, PRECISIONS[p][0], kernels, pack=PRECISIONS[p][1])
                t0 = time.perf_counter()
                model(batch, pool)
                times[p].append(time.perf_counter() - t0)
        print(f"decode, {rows} sequence(s): " + ", ".join(
            f"{p} {statistics.median(v) * 1000:.1f} ms (min {min(v) * 1000:.1f})" for p, v in times.items()))
    ids = torch.randint(3, model.args.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    for _ in range(2):
        for p in names:
            set_precision(model, PRECISIONS[p][0], kernels, pack=PRECISIONS[p][1])
            table = PageTable(pool)
            table.ensure(prompt)
            t0 = time.perf_counter()
            for s in range(0, prompt, 256):
                model(make_batch([(ids[s : s + 256], s, table.pages, [-1])], PAGE, prompt_ends=[prompt]), pool)
            print(f"prompt of {prompt} tokens in chunks of 256: {p} {time.perf_counter() - t0:.2f} s")
            pool.release(table.pages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="folder or .gguf (default: the pulled default model)")
    ap.add_argument("--only", choices=["matrices", "forward"], default=None)
    ap.add_argument("--reps", type=int, default=10, help="decode steps of each precision, alternating")
    ap.add_argument("--prompt", type=int, default=1000)
    args = ap.parse_args()
    from webchat.files.gguf_cache import model_folder

    folder = model_folder(args.model) if args.model else default_model()
    model = load_model(folder)
    print(f"{folder.name}: default precision {model.precision}, path {build.path_name(build.load())}, "
          f"{torch.get_num_threads()} threads")
    if args.only != "forward":
        matrices(model)
    if args.only != "matrices":
        forward(model, args.reps, args.prompt)


if __name__ == "__main__":
    main()
