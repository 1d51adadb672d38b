"""What a step of T decode/verify rows costs on this model and machine: the curve speculation is planned against.

    curve = measure(model, pool)        # {rows: ms}: one sequence's T rows at a 256-token context, median of passes
    cost = VerifyCost(curve)            # monotone in T, interpolated, extrapolated on the last segment's slope
    cost.forward_ms(rows)
    cycles = Cycles()                   # the work between forwards, measured as the engine runs

A verify forward of k+1 rows is measured as one sequence's rows because rows of any sequences cost alike: the CPU
row kernels take every non-prompt row of a step in groups (webchat/kernels/cpu/csrc/qmatmul.cpp) and attention is per
row over its own context (bench/bench_verify_cost.py prints both shapes). The measurement is made robust to a shared,
noisy machine, whose noise only ever slows a forward: passes alternate their order (small to large, then large to
small), each point keeps the fastest of its passes, and those are made non-decreasing in T (pool-adjacent-violators),
so a forward slowed by another process moves no decision. The passes stop after BUDGET_S (at least MIN_PASSES), so a
loaded machine does not stall the start-up. The time between forwards (sampling, delivery, the server's other
threads) is measured as the engine runs (`Cycles`), as the median of the recent steps.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from webchat.engine.sampling import Sampler
from webchat.engine.settings import SamplingSettings
from webchat.model.batch import Batch, make_batch
from webchat.model.kv_cache import KVPool, PageTable, PoolExhausted

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24)  # rows measured; past the last, the last segment's slope
PASSES = 5
MIN_PASSES = 2
BUDGET_S = 3.0  # passes after the second start only within this time
CONTEXT = 256  # the measured rows' position: a chat's typical context
CYCLES = 31  # recent steps whose outside-forward time is kept (median)
IDLE_GAP_S = 0.25  # a gap between steps longer than this was idle time, not overhead


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to values in least squares (pool adjacent violators)."""
    blocks: list[tuple[float, int]] = []  # (mean, count)
    for v in values:
        blocks.append((v, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (a, n), (b, m) = blocks[-2], blocks[-1]
            blocks[-2:] = [((a * n + b * m) / (n + m), n + m)]
    return [mean for mean, count in blocks for _ in range(count)]


class VerifyCost:
    """Forward ms by row count, from a measured curve: interpolated between its points, non-decreasing, and
    extrapolated past the last point on the slope of the last segment (at least the mean slope)."""

    def __init__(self, curve: dict[int, float]) -> None:
        if not curve or min(curve) < 1:
            raise ValueError(f"a cost curve needs points at rows >= 1, got {sorted(curve)}")
        self.rows = sorted(curve)
        self.ms = isotonic([max(0.0, curve[t]) for t in self.rows])
        self.curve = dict(zip(self.rows, self.ms, strict=True))
        last, first = self.rows[-1], self.rows[0]
        mean = (self.ms[-1] - self.ms[0]) / (last - first) if last > first else self.ms[0] / last
        tail = (self.ms[-1] - self.ms[-2]) / (last - self.rows[-2]) if len(self.rows) > 1 else mean
        self.slope = max(tail, mean, 0.0)
        self._table = [self._interpolate(t) for t in range(0, 65)]

    @classmethod
    def flat(cls, ms: float = 1.0) -> VerifyCost:
        """A forward that costs the same for any row count: every draft with a chance pays (tests)."""
        return cls({1: ms, 64: ms})

    def forward_ms(self, rows: int) -> float:
        if rows < len(self._table):
            return self._table[rows]
        return self._interpolate(rows)

    def _interpolate(self, rows: int) -> float:
        xs, ys = self.rows, self.ms
        if rows <= xs[0]:
            return ys[0] * max(rows, 0) / xs[0]  # fewer rows than measured: no cheaper than proportionally
        if rows >= xs[-1]:
            return ys[-1] + self.slope * (rows - xs[-1])
        for i in range(1, len(xs)):
            if rows <= xs[i]:
                f = (rows - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + f * (ys[i] - ys[i - 1])
        raise AssertionError("unreachable: rows within the curve")

    def wire(self) -> dict[str, object]:
        """The curve as /api/info shows it."""
        return {"forward_ms": {str(t): round(ms, 3) for t, ms in self.curve.items()},
                "slope_ms_per_row": round(self.slope, 3)}


class Cycles:
    """The engine's time between forwards (sampling, emitting, the worker's delivery, the server's other threads),
    the median over the last CYCLES busy steps; idle gaps (no step waiting) are left out."""

    def __init__(self, overhead_ms: float = 0.0) -> None:
        self.overhead_ms = overhead_ms
        self._recent: deque[float] = deque(maxlen=CYCLES)
        self._last_end = 0.0
        self._seen = 0

    def forward_began(self, now: float) -> None:
        """Called as a forward starts: the time since the last forward ended was spent outside forwards."""
        if self._last_end and now - self._last_end < IDLE_GAP_S:
            self._recent.append((now - self._last_end) * 1000)
            self._seen += 1
            if self._seen % 8 == 1:  # the median every 8 steps (a sort of 31 values)
                self.overhead_ms = statistics.median(self._recent)

    def forward_ended(self, now: float) -> None:
        self._last_end = now


def measure(model: Callable[[Batch, KVPool], torch.Tensor], pool: KVPool, grid: Sequence[int] = GRID,
            passes: int = PASSES, context: int = CONTEXT) -> dict[int, float]:
    """{rows: ms} of verify forwards (every row's logits) of one sequence at `context`, on free pages of `pool`
    taken for the measurement and given back (zeroed first: attention reads finite values); a pool with fewer free
    slots measures at a shorter context, and only the rows that fit. Raises PoolExhausted when not one row fits."""
    free = len(pool.free) * pool.page_size  # free pages only: no idle session is evicted to measure
    grid = [t for t in grid if t <= free]
    if not grid:
        raise PoolExhausted(f"no free KV slot to measure verify rows in ({len(pool.free)} free pages)")
    top = max(grid)
    context = max(0, min(context, free - top))
    table = PageTable(pool)
    try:
        table.ensure(context + top)
        pages = torch.tensor(table.pages, dtype=torch.long, device=pool.k[0].device)
        for layer in (*pool.k, *pool.v):
            layer.index_fill_(0, pages, 0.0)
        device = pool.k[0].device

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def once(rows: int) -> float:
            batch = make_batch([([1 + i for i in range(rows)], context, table.pages, list(range(rows)))],
                               pool.page_size, device)
            t = time.perf_counter()
            model(batch, pool)
            sync()
            return (time.perf_counter() - t) * 1000

        for rows in (1, 1, top):  # warm: kernels, caches, scratch buffers at their largest
            once(rows)
        samples: dict[int, list[float]] = {t: [] for t in grid}
        start = time.perf_counter()
        for p in range(passes):
            if p >= MIN_PASSES and time.perf_counter() - start > BUDGET_S:
                break
            for rows in grid if p % 2 == 0 else reversed(grid):
                samples[rows].append(once(rows))
        return {t: min(ms) for t, ms in samples.items()}
    finally:
        table.release()


def calibrate(model: Callable[[Batch, KVPool], torch.Tensor], pool: KVPool) -> VerifyCost | None:
    """A VerifyCost measured now, or None when the pool has no free slot to measure in (try again later)."""
    try:
        return VerifyCost(measure(model, pool))
    except PoolExhausted:
        return None


def sampling_ms(vocab: int, repeats: int = 5) -> float:
    """One sampled row (the default settings: temperature, top-k, top-p, min-p), as a sampled sequence's verify
    rows are drawn one at a time."""
    sampler = Sampler(SamplingSettings(seed=0), vocab)
    row, history = torch.randn(vocab), list(range(64))
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        sampler.sample(row, history)
        times.append((time.perf_counter() - t) * 1000)
    return min(times[1:])


def draft_ms(draft: Callable[[Batch, KVPool], torch.Tensor], pool: KVPool) -> float:
    """One draft-model token: a one-row forward at a short context, on a pool of the draft model's own."""
    return measure(draft, pool, grid=(1,), context=64)[1]
