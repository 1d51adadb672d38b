"""The device thread's OpenMP team, sized to the cores other processes leave it.

A user's machine is rarely idle. With another process busy on one of two cores, a 2-thread team waits at each of a
token's ~150 barriers for the thread that shares its core with that process, and the scheduler lets that thread run
only in its turns: measured with the default model and one core kept busy (`python -m bench.bench_reliability
--rows 5`), another client's stream paused up to 1.0 s in 20 s with a team of 2, and at most 0.11 s with a team of 1.
On an idle machine the team of 2 is the faster. So the team follows the load:

    governor = CoreGovernor(most=torch.get_num_threads())
    ...between steps, on the device thread:
    n = governor.poll()          # None, or the team size to use from now on
    if n is not None: torch.set_num_threads(n)

Every WINDOW_S the governor reads how much of this process's CPUs (its affinity) other processes kept busy:
/proc/stat's busy time on those CPUs less this process's own. Time of niced processes (/proc/stat's `nice` column) is
left out, since the scheduler gives ours the core before theirs (our own niced threads, the grammar compiler and the
side loader, are left out of our own time to match). A core goes from the team once others keep 0.65 of it busy
(OTHERS_DOWN), at once, since every contended step stalls; it comes back once they keep it under 0.35 busy (OTHERS_UP)
for UP_WINDOWS windows in a row. The default path's numbers do not depend on the team size (each output row is
computed by one thread); `--exact`'s float32 GEMM splits its sums by thread, so its logits can move by ~5e-5 when the
team changes.
`serve --threads N` fixes the team at N and turns this off.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("webchat.serve.cores")

WINDOW_S = 0.5  # how often the load is read (each read: two small /proc files and one per niced thread)
UP_WINDOWS = 3  # windows in a row that must leave a core free before the team grows again
OTHERS_DOWN = 0.65  # other processes' busy share of a core that takes that core from the team
OTHERS_UP = 0.35  # ... and under which it is given back (between the two, the team stays as it is)
STALE_S = 3 * WINDOW_S  # a read older than this (the device slept) starts a new window instead of deciding


@dataclass(frozen=True)
class CpuSample:
    """Counters in clock ticks, summed over this process's CPUs."""

    total: int  # every state, idle included: the window's capacity
    busy: int  # user + system + irq + softirq + steal, niced processes' user time left out
    own: int  # this process's user + system time, its niced threads' left out


def _ticks_of_thread(stat: str) -> tuple[int, int]:
    """(utime + stime, nice) of a /proc/<pid>/[task/<tid>/]stat line (fields after the command's closing ')')."""
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12]), int(fields[16])


def read_sample(cpus: frozenset[int], proc: Path = Path("/proc")) -> CpuSample | None:
    """The counters now, or None where /proc does not give them."""
    try:
        total = busy = 0
        for line in (proc / "stat").read_text().splitlines():
            name, *values = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                continue
            user, _nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in values[:8])
            total += user + _nice + system + idle + iowait + irq + softirq + steal
            busy += user + system + irq + softirq + steal
        own, _ = _ticks_of_thread((proc / "self" / "stat").read_text())
        for task in (proc / "self" / "task").iterdir():
            try:
                ticks, nice = _ticks_of_thread((task / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue  # the thread ended meanwhile
            if nice > 0:
                own -= ticks
    except (OSError, ValueError, IndexError):
        return None
    return CpuSample(total, busy, max(own, 0)) if total else None


def others_cores(before: CpuSample, after: CpuSample, cores: int) -> float:
    """How many of `cores` other (un-niced) processes kept busy between two samples."""
    span = after.total - before.total
    if span <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others / span * cores)


class CoreGovernor:
    """Decides the team size from the load; `poll()` is cheap between reads."""

    def __init__(self, most: int, cpus: frozenset[int] | None = None,
                 read: Callable[[frozenset[int]], CpuSample | None] = read_sample,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self.most = max(1, min(most, len(self.cpus)))
        self.threads = self.most
        self.others = 0.0  # the last window's figure, for the log and /api/info
        self._read, self._clock = read, clock
        self._last = read(self.cpus)
        self._at = clock()
        self._up = 0  # windows in a row that left room for a larger team
        self.enabled = self.most > 1 and self._last is not None

    def poll(self) -> int | None:
        """The team size to switch to, when a window has ended and says so; else None."""
        if not self.enabled:
            return None
        now = self._clock()
        if now - self._at < WINDOW_S:
            return None
        sample = self._read(self.cpus)
        if sample is None:
            self.enabled = False
            return None
        before, stale = self._last, now - self._at > STALE_S
        self._last, self._at = sample, now
        if before is None or stale:
            return None
        self.others = others_cores(before, sample, len(self.cpus))
        cores = len(self.cpus)
        down = max(1, min(self.most, cores - int(self.others + 1 - OTHERS_DOWN)))  # a core goes at 0.65 of it busy
        up = max(1, min(self.most, cores - int(self.others + 1 - OTHERS_UP)))  # and comes back under 0.35
        if down < self.threads:
            self._up = 0
            return self._set(down)
        if up > self.threads:
            self._up += 1
            if self._up >= UP_WINDOWS:
                self._up = 0
                return self._set(up)
            return None
        self._up = 0
        return None

    def _set(self, threads: int) -> int:
        log.info("device threads %d -> %d: other processes kept %.2f of %d cores busy", self.threads, threads,
                 self.others, len(self.cpus))
        self.threads = threads
        return threads
