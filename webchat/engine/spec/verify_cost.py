"""What a step of T decode/verify rows costs on this model and machine: the curve speculation is planned against.

    curve = measure(model, pool)        # {rows: ms}: one sequence's T rows at a 256-token context, median of passes
    cost = VerifyCost(curve)            # interpolated, lowered to the physical bounds, tabulated to 64 rows
    cost.forward_ms(rows)
    cost.observe(rows, ms)              # a forward the engine ran: the curve's scale follows them
    cycles = Cycles()                   # the work between forwards, measured as the engine runs

A verify forward of k+1 rows is measured as one sequence's rows because rows of any sequences cost alike: the CPU
row kernels take every non-prompt row of a step in groups (webchat/kernels/cpu/csrc/qmatmul.cpp) and attention is per
row over its own context (bench/bench_verify_cost.py prints both shapes). The measurement is made robust to a shared,
noisy machine, whose noise only ever slows a forward: passes alternate their order (small to large, then large to
small), each point keeps the fastest of its passes, and the curve is lowered to two physical bounds no true cost
exceeds (more rows never cost less; one forward of a + b rows never costs more than two), so a forward slowed by
another process moves no decision. The passes stop after BUDGET_S (at least MIN_PASSES), so a loaded machine does not
stall the start-up. As the engine runs, the curve is scaled by how its forwards compare with it, and the time between
forwards (sampling, delivery, the server's other threads) is measured (`Cycles`), each the median of recent steps.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import TypeVar

import torch

from webchat.engine.sampling import Sampler
from webchat.engine.settings import SamplingSettings
from webchat.model.batch import Batch, make_batch
from webchat.model.kv_cache import KVPool, PageTable, PoolExhausted

R = TypeVar("R")

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24)  # rows measured; past the last, the last segment's slope
PASSES = 5
MIN_PASSES = 2
BUDGET_S = 3.0  # passes after the second start only within this time
CONTEXT = 256  # the measured rows' position: a chat's typical context
CYCLES = 31  # recent steps whose outside-forward time (and forward against the curve) is kept (median)
TABLE_ROWS = 64  # rows the curve is tabulated for (the CPU step's one call)
IDLE_GAP_S = 0.25  # a gap between steps longer than this was idle time, not overhead


def lowered(values: Sequence[float]) -> list[float]:
    """values (a forward's ms for 1, 2, ... rows: index 0 is 0 rows) lowered to the physical bounds a noisy sample
    can exceed but the true cost cannot: more rows never cost less (c(T) <= c(T + 1)), and one forward of a + b rows
    never costs more than two (c(a + b) <= c(a) + c(b)). Only ever lowered: the noise only ever slows."""
    t = list(values)
    for rows in range(2, len(t)):
        t[rows] = min(t[rows], *(t[a] + t[rows - a] for a in range(1, rows // 2 + 1)))
    for rows in range(len(t) - 2, 0, -1):
        t[rows] = min(t[rows], t[rows + 1])
    return t


class VerifyCost:
    """Forward ms by row count: the measured points interpolated (and extrapolated on the slope of their last segment,
    at least their mean slope) up to TABLE_ROWS, lowered to the physical bounds (`lowered`), and scaled by how the
    forwards the engine runs compare with it (`observe`: the median ratio of the last CYCLES, within [1/4, 4])."""

    def __init__(self, curve: dict[int, float]) -> None:
        if not curve or min(curve) < 1:
            raise ValueError(f"a cost curve needs points at rows >= 1, got {sorted(curve)}")
        xs = sorted(curve)
        ys = [max(0.0, curve[t]) for t in xs]
        mean = (ys[-1] - ys[0]) / (xs[-1] - xs[0]) if len(xs) > 1 else ys[0] / xs[0]
        tail = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else mean
        dense = [interpolate(xs, ys, max(tail, mean, 0.0), rows) for rows in range(TABLE_ROWS + 1)]
        self._table = lowered(dense)
        self.curve = {t: self._table[t] for t in xs if t <= TABLE_ROWS}
        self.slope = (self._table[-1] - self._table[TABLE_ROWS // 2]) / (TABLE_ROWS - TABLE_ROWS // 2)
        self.scale = 1.0
        self._ratios: deque[float] = deque(maxlen=CYCLES)
        self._seen = 0

    @classmethod
    def flat(cls, ms: float = 1.0) -> VerifyCost:
        """A forward that costs the same for any row count: every draft with a chance pays (tests)."""
        return cls({1: ms, TABLE_ROWS: ms})

    def forward_ms(self, rows: int) -> float:
        if rows <= TABLE_ROWS:
            return self._table[max(rows, 0)] * self.scale
        return (self._table[-1] + self.slope * (rows - TABLE_ROWS)) * self.scale

    def added_ms(self, base: int, rows: int) -> float:
        """What a forward of `rows` rows costs beyond one of `base` rows: the curve's difference, scaled by the scale
        where the forwards run slower than the curve and never scaled down. The scale follows the steps the engine
        runs, nearly all without drafts, whose rows attend to the live contexts: a scale under 1 says those are
        shorter than the curve's, not that a verify row's matrices cost less (4 open chats: scale 0.91, and their
        steps with 5-9 rows cost 7-11% more than the curve scaled)."""
        return (self.forward_ms(rows) - self.forward_ms(base)) / min(1.0, self.scale)

    def observe(self, rows: int, ms: float) -> None:
        """A forward of `rows` decode/verify rows (no prompt rows) took ms."""
        if not 0 < rows <= TABLE_ROWS or self._table[rows] <= 0:
            return
        self._ratios.append(ms / self._table[rows])
        self._seen += 1
        if self._seen % 8 == 1:  # the median every 8 forwards (a sort of 31 values)
            self.scale = min(4.0, max(0.25, statistics.median(self._ratios)))

    def wire(self) -> dict[str, object]:
        """The curve as /api/info shows it."""
        return {"forward_ms": {str(t): round(ms * self.scale, 3) for t, ms in self.curve.items()},
                "slope_ms_per_row": round(self.slope * self.scale, 3), "scale": round(self.scale, 3)}


def interpolate(xs: Sequence[int], ys: Sequence[float], slope: float, rows: int) -> float:
    """ys at rows: linear between the points, on `slope` past the last, proportional below the first."""
    if rows <= xs[0]:
        return ys[0] * max(rows, 0) / xs[0]
    if rows >= xs[-1]:
        return ys[-1] + slope * (rows - xs[-1])
    i = next(i for i in range(1, len(xs)) if rows <= xs[i])
    return ys[i - 1] + (rows - xs[i - 1]) / (xs[i] - xs[i - 1]) * (ys[i] - ys[i - 1])


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
            passes: int = PASSES, context: int = CONTEXT, positions: int | None = None) -> dict[int, float]:
    """{rows: ms} of verify forwards (every row's logits) of one sequence at `context`, on free pages of `pool`
    taken for the measurement and given back (zeroed first: attention reads finite values); with fewer free slots
    (or fewer `positions`, the model's context) it measures at a shorter context, and only the rows that fit.
    Raises PoolExhausted when not one row fits."""
    return drain(measure_steps(model, pool, grid, passes, context, positions))


def drain(steps: Generator[None, None, R]) -> R:
    """Run a generator of steps to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


def measure_steps(model: Callable[[Batch, KVPool], torch.Tensor], pool: KVPool, grid: Sequence[int] = GRID,
                  passes: int = PASSES, context: int = CONTEXT,
                  positions: int | None = None) -> Generator[None, None, dict[int, float]]:  # fmt: skip
    """measure(), one forward a step: a caller that steps it between other work (a model loaded beside running
    streams) holds the device for one verify forward at a time."""
    free = len(pool.free) * pool.page_size  # free pages only: no idle session is evicted to measure
    if positions is not None:
        free = min(free, positions)
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
            yield
        samples: dict[int, list[float]] = {t: [] for t in grid}
        start = time.perf_counter()
        for p in range(passes):
            if p >= MIN_PASSES and time.perf_counter() - start > BUDGET_S:
                break
            for rows in grid if p % 2 == 0 else reversed(grid):
                samples[rows].append(once(rows))
                yield
        return {t: min(ms) for t, ms in samples.items()}
    finally:
        table.release()


def calibrate(model: Callable[[Batch, KVPool], torch.Tensor], pool: KVPool, positions: int) -> VerifyCost | None:
    """A VerifyCost measured now within the first `positions` positions, or None when the pool has no free slot to
    measure in (try again later)."""
    return drain(calibration(model, pool, positions))


def calibration(model: Callable[[Batch, KVPool], torch.Tensor], pool: KVPool,
                positions: int) -> Generator[None, None, VerifyCost | None]:  # fmt: skip
    """calibrate(), one forward a step."""
    try:
        return VerifyCost((yield from measure_steps(model, pool, positions=positions)))
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


def draft_ms(draft: Callable[[Batch, KVPool], torch.Tensor], pool: KVPool, positions: int) -> float:
    """One draft-model token: a one-row forward at a short context, on a pool of the draft model's own."""
    return measure(draft, pool, grid=(1,), context=64, positions=positions)[1]
