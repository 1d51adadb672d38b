"""How many prompt rows a step may take: a step's cost fitted as fixed + per row, from the steps just taken.

    cost = StepCost(); cost.add(rows=32, seconds=0.21); ...
    cost.rows_within(0.2)   # rows a step may hold to take about 0.2 s; None before any step was timed

A step's fixed part is what it pays whatever its rows: the weights read once (milliseconds on the default path), and
for a prompt scored at float32 the weight tiles unpacked for the GEMM (about 110 ms a step on one core of this
2-core machine, for the default model, next to ~3 ms a row). Dividing a step's time by its rows would count that
fixed part as rows' and shrink the chunks of a scored prompt until nothing but the fixed part is left; a least-squares
line through the last WINDOW steps of a kind (their row counts differ as the chunk follows the depth) keeps the two
apart. The per-row part grows with the prompt's depth (attention reads every earlier position), so only recent steps
count.
"""

from __future__ import annotations

from collections import deque

WINDOW = 8


class StepCost:
    """A kind of step's recent (rows, seconds) and the line through them."""

    def __init__(self, window: int = WINDOW) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds > 0:
            self.samples.append((rows, seconds))

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row); None before any step."""
        if not self.samples:
            return None
        n = len(self.samples)
        mx = sum(r for r, _ in self.samples) / n
        my = sum(s for _, s in self.samples) / n
        sxx = sum((r - mx) ** 2 for r, _ in self.samples)
        if sxx > 0:
            per = sum((r - mx) * (s - my) for r, s in self.samples) / sxx
            fixed = my - per * mx
            if per > 0 and fixed >= 0:
                return fixed, per
        return 0.0, my / mx  # one row count so far, or a line the noise bent: all of it per row

    def rows_within(self, seconds: float) -> int | None:
        line = self.line()
        if line is None:
            return None
        fixed, per = line
        return int(max(0.0, seconds - fixed) / per)
