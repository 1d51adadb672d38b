"""What verify rows cost on this CPU: a forward of k+1 rows against a one-row step, alone and inside a batch.

    .venv/bin/python -m bench.bench_verify_cost [--model DIR] [--passes 7] [--context 256]

Prints, on the default model (or --model), each shape's forward time (fastest and median of --passes alternating
passes: the machine is shared and its noise only slows), as ms and as one-row steps:
  alone     one sequence, k+1 rows (a verify forward), k = 0..16
  batch B   B decoding sequences, one of them verifying k drafts (B = 4, 16)
  all B     B sequences each verifying k drafts
  gemm      the same k+1 rows as prompt rows (the GEMM path, qgemm.cpp), for comparison only: a verify row must give
            the bits of a lone decode row, which the row kernels do and the GEMM does not
and the ceiling of speculation at B = 1, 4, 16 sequences: tokens per ms if every sequence verified k drafts a step
and all were accepted (the `all B` shapes at their best k, rows at most the step's 64), over B decoding sequences'
tokens per ms. No draft source, however good, gets decode past it on this model and CPU.
and the cost curve the auto mode's planner would measure here (webchat.engine.spec.verify_cost, as at the server's
warm-up).
The marginal row (ms per extra row) against the one-row step is what a drafted token must beat: at ratio x a draft
of k tokens pays only when its expected accepted tokens exceed k * x.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import default_model, table_header, table_row
from webchat.engine.spec import verify_cost
from webchat.model.batch import make_batch
from webchat.model.kv_cache import KVPool, PageTable
from webchat.model.transformer import Transformer

KS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
ALL_KS = {4: (1, 2, 4, 7, 11, 15), 16: (1, 2, 3)}  # every sequence k drafts: up to the step's 64 rows


class Shapes:
    """Forwards of a given shape on pages of the model's own pool, filled with zeros."""

    def __init__(self, model: Transformer, context: int, seqs: int = 16) -> None:
        self.model, self.context = model, context
        self.pool: KVPool = model.new_pool((context + 32) * seqs + 64)
        self.tables = []
        for _ in range(seqs):
            table = PageTable(self.pool)
            table.ensure(context + 32)
            self.tables.append(table)
        for layer in (*self.pool.k, *self.pool.v):
            layer.zero_()

    def forward(self, rows: list[int], prompt: bool = False) -> float:
        """ms of one forward: sequence b feeds rows[b] tokens at the context, every row's logits (as verify does);
        prompt: the rows are prompt rows (the GEMM path)."""
        spec = [([1 + i for i in range(n)], self.context, self.tables[b].pages, list(range(n)))
                for b, n in enumerate(rows)]
        ends = [self.context + 32 if prompt else 0] * len(rows)
        batch = make_batch(spec, self.pool.page_size, "cpu", ends)
        t = time.perf_counter()
        self.model(batch, self.pool)
        return (time.perf_counter() - t) * 1000


@dataclass
class Shape:
    name: str
    rows: list[int]  # tokens fed per sequence
    base: str  # the shape without the drafts
    prompt: bool = False

    @property
    def total(self) -> int:
        return sum(self.rows)


def shapes() -> list[Shape]:
    out = []
    for k in KS:
        out.append(Shape(f"alone k={k}", [k + 1], "alone k=0"))
        out.append(Shape(f"gemm k={k}", [k + 1], "gemm k=0", prompt=True))
    for b in (4, 16):
        out += [Shape(f"batch {b} k={k}", [k + 1] + [1] * (b - 1), f"batch {b} k=0") for k in KS]
        out += [Shape(f"all {b} k={k}", [k + 1] * b, f"batch {b} k=0") for k in ALL_KS[b]]
    return out


def run(s: Shapes, todo: list[Shape], passes: int) -> dict[str, tuple[float, float]]:
    """(fastest, median) ms of each shape over passes that alternate their order."""
    samples: dict[str, list[float]] = {x.name: [] for x in todo}
    for p in range(passes):
        for x in todo if p % 2 == 0 else reversed(todo):
            samples[x.name].append(s.forward(x.rows, x.prompt))
    return {n: (min(v), statistics.median(v)) for n, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    from webchat.kernels.backend import load_model

    path = args.model or default_model()
    model = load_model(path)
    s = Shapes(model, args.context)
    for _ in range(3):
        s.forward([1])
    todo = shapes()
    by_name = {x.name: x for x in todo}
    got = run(s, todo, args.passes)
    step = got["alone k=0"][0]
    print(f"{path.name}, {torch.get_num_threads()} threads, context {args.context}, {args.passes} alternating passes;"
          f" one-row step {step:.2f} ms (fastest)")
    print(table_header("shape", "rows", "fastest ms", "median ms", "/ 1-row step", "ms / extra row"))
    for x in todo:
        fast, med = got[x.name]
        extra = x.total - by_name[x.base].total
        marginal = f"{(fast - got[x.base][0]) / extra:.2f}" if extra else "-"
        print(table_row(x.name, x.total, f"{fast:.2f}", f"{med:.2f}", f"{fast / step:.2f}", marginal))
    print("\nthe ceiling (every draft accepted): the best k's tokens per ms over the same sequences' without drafts")
    print(table_header("sequences", "no drafts tok/s", "every draft accepted tok/s", "best k", "ceiling"))
    for b in (1, 4, 16):
        base, drafted = ("alone k=0", "alone k=") if b == 1 else (f"batch {b} k=0", f"all {b} k=")
        runs = [(x.rows[0] - 1, x.total / got[x.name][0]) for x in todo if x.name.startswith(drafted)]
        k, best = max(runs, key=lambda r: r[1])
        print(table_row(b, f"{b / got[base][0] * 1000:.0f}", f"{best * 1000:.0f}", k,
                        f"{best * got[base][0] / b:.2f}x"))
    pool = model.new_pool(2048)
    t = time.perf_counter()
    cost = verify_cost.VerifyCost(verify_cost.measure(model, pool, positions=model.args.max_seq_len))
    took = time.perf_counter() - t
    print(f"\nthe auto mode's curve as measured at warm-up ({took:.1f} s): rows -> ms, fastest of its passes, made "
          "non-decreasing")
    print("  " + ", ".join(f"{t}: {ms:.2f}" for t, ms in cost.curve.items()) +
          f"; past {max(cost.curve)}: +{cost.slope:.2f} ms a row")
    print(f"  marginal row / one-row forward: {(cost.forward_ms(5) - cost.forward_ms(1)) / 4 / cost.forward_ms(1):.2f}"
          f" (k=4 verify: {cost.forward_ms(5) / cost.forward_ms(1):.2f} one-row forwards)")


if __name__ == "__main__":
    main()
