"""The device's OpenMP team follows the cores other processes leave it (webchat.serve.cores): /proc read as the kernel
writes it, the decision's thresholds and patience, the device thread switching its own team, and a real busy process
seen on this machine's /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from webchat.serve.cores import UP_WINDOWS, WINDOW_S, CoreGovernor, CpuSample, others_cores, read_sample
from webchat.serve.device import DeviceThread


def thread_stat(pid: int, comm: str, utime: int, stime: int, nice: int) -> str:
    """A /proc/<pid>/stat line: pid (comm) state, then fields 4.. with utime 14, stime 15, nice 19 (1-based)."""
    fields = ["S"] + ["0"] * 10 + [str(utime), str(stime), "0", "0", "20", str(nice)] + ["0"] * 30
    return f"{pid} ({comm}) " + " ".join(fields)


def fake_proc(root: Path, cpus: dict[int, tuple[int, ...]], process: tuple[int, int],
              threads: list[tuple[int, int, int]]) -> Path:
    """/proc/stat with per-CPU lines (user nice system idle iowait irq softirq steal), /proc/self/stat with the
    process's (utime, stime) and a task per (utime, stime, nice); the command names hold spaces and ')' as real ones
    may."""
    lines = ["cpu  " + " ".join(str(sum(v[i] for v in cpus.values())) for i in range(8)) + " 0 0"]
    lines += [f"cpu{n} " + " ".join(map(str, v)) + " 0 0" for n, v in cpus.items()]
    lines += ["intr 1 2 3", "ctxt 99"]
    (root / "self" / "task").mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text("\n".join(lines) + "\n")
    (root / "self" / "stat").write_text(thread_stat(7, "python (x)", *process, 0))
    for i, (u, s, nice) in enumerate(threads):
        (root / "self" / "task" / str(100 + i)).mkdir(exist_ok=True)
        (root / "self" / "task" / str(100 + i) / "stat").write_text(thread_stat(100 + i, f"t {i})", u, s, nice))
    return root


def test_a_sample_counts_only_our_cpus_leaves_niced_time_out_and_our_niced_threads_too(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {0: (100, 50, 20, 800, 10, 5, 5, 10), 1: (300, 0, 40, 600, 0, 0, 0, 0),
                                2: (999, 999, 999, 999, 0, 0, 0, 0)},
                     process=(70, 30), threads=[(40, 10, 0), (25, 5, 10), (30, 15, 0)])
    sample = read_sample(frozenset({0, 1}), proc)
    assert sample == CpuSample(total=1000 + 940, busy=(100 + 20 + 5 + 5 + 10) + (300 + 40), own=100 - 30)


def test_a_sample_is_none_where_proc_does_not_give_one(tmp_path: Path) -> None:
    assert read_sample(frozenset({0}), tmp_path) is None  # no /proc/stat at all
    proc = fake_proc(tmp_path, {0: (1, 0, 1, 10, 0, 0, 0, 0)}, (1, 1), [])
    assert read_sample(frozenset({5}), proc) is None  # none of our CPUs listed


def test_others_are_the_busy_time_that_is_not_ours_in_cores() -> None:
    a, b = CpuSample(total=1000, busy=300, own=200), CpuSample(total=1200, busy=450, own=300)
    assert others_cores(a, b, cores=2) == pytest.approx(50 / 200 * 2)
    assert others_cores(a, CpuSample(total=1200, busy=350, own=400), cores=2) == 0.0  # never below nothing
    assert others_cores(a, a, cores=2) == 0.0


class Script:
    """A governor's clock and reads, driven by the test: each window, other processes' busy share in cores."""

    def __init__(self) -> None:
        self.now = 0.0
        self.total = self.busy = self.own = 0

    def read(self, _cpus: frozenset[int]) -> CpuSample:
        return CpuSample(self.total, self.busy, self.own)

    def clock(self) -> float:
        return self.now

    def window(self, others: float, ours: float = 1.0, seconds: float = WINDOW_S) -> None:
        """Advance a window in which others kept `others` of 2 cores busy and we `ours` (100 ticks a core-window)."""
        self.now += seconds
        self.total += 200
        self.busy += round(100 * (others + ours))
        self.own += round(100 * ours)


def governed(script: Script, most: int = 2) -> CoreGovernor:
    return CoreGovernor(most, cpus=frozenset({0, 1}), read=script.read, clock=script.clock)


def test_the_team_gives_up_a_core_at_once_and_takes_it_back_only_after_quiet_windows_in_a_row() -> None:
    s = Script()
    gov = governed(s)
    assert gov.enabled and gov.threads == 2
    s.window(others=0.1)
    assert gov.poll() is None  # quiet: the team stays whole
    s.window(others=0.9)
    assert gov.poll() == 1 and gov.threads == 1  # a busy core: at once
    for _ in range(UP_WINDOWS - 1):
        s.window(others=0.1)
        assert gov.poll() is None  # quiet, but not yet for long enough
    s.window(others=0.9)
    assert gov.poll() is None  # busy again: the count of quiet windows starts over
    for _ in range(UP_WINDOWS - 1):
        s.window(others=0.05)
        assert gov.poll() is None
    s.window(others=0.05)
    assert gov.poll() == 2 and gov.threads == 2


def test_between_the_thresholds_the_team_stays_as_it_is() -> None:
    s = Script()
    gov = governed(s)
    s.window(others=0.5)
    assert gov.poll() is None and gov.threads == 2  # half a core busy does not take it
    s.window(others=0.8)
    assert gov.poll() == 1
    for _ in range(2 * UP_WINDOWS):
        s.window(others=0.5)
        assert gov.poll() is None and gov.threads == 1  # nor does half a core give it back
    s.window(others=1.9)
    assert gov.poll() is None and gov.threads == 1  # never fewer than one thread


def test_reads_between_windows_and_after_a_sleep_decide_nothing() -> None:
    s = Script()
    gov = governed(s)
    s.window(others=1.0, seconds=WINDOW_S / 4)
    assert gov.poll() is None and gov.threads == 2  # the window has not ended
    s.window(others=1.0, seconds=10 * WINDOW_S)
    assert gov.poll() is None and gov.threads == 2  # the device slept: a new window starts from here
    s.window(others=1.0)
    assert gov.poll() == 1


def test_one_core_or_no_proc_means_no_governor() -> None:
    s = Script()
    assert not CoreGovernor(1, cpus=frozenset({0, 1}), read=s.read, clock=s.clock).enabled
    assert not CoreGovernor(4, cpus=frozenset({0}), read=s.read, clock=s.clock).enabled  # one CPU to run on
    assert not CoreGovernor(2, cpus=frozenset({0, 1}), read=lambda _c: None, clock=s.clock).enabled


def test_the_device_thread_sets_its_own_team_as_the_governor_says() -> None:
    s = Script()
    device = DeviceThread(governor=lambda most: governed(s, most=2))
    device.start()
    try:
        assert device.call(torch.get_num_threads).result(10) == 2
        s.window(others=1.0)
        assert device.call(torch.get_num_threads).result(10) == 1  # polled before the call ran: the team is 1
        assert device.team() == {"threads": 1, "most": 2, "adaptive": True, "others_busy_cores": 1.0}
        for _ in range(UP_WINDOWS):
            s.window(others=0.0)
            device.call(lambda: None).result(10)
        assert device.call(torch.get_num_threads).result(10) == 2
    finally:
        device.stop()
    fixed = DeviceThread(threads=1)
    fixed.start()
    try:
        assert fixed.call(torch.get_num_threads).result(10) == 1
        assert fixed.governor is None and fixed.team() == {"threads": 1, "adaptive": False}
    finally:
        fixed.stop()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not Path("/proc/stat").exists(),
                    reason="needs Linux's /proc and two CPUs to share")
@pytest.mark.skipif(os.nice(0) > 0, reason="a niced test run's spinner is niced too, and niced load is left out")
def test_a_real_busy_process_is_seen_and_its_end_too() -> None:
    cpus = frozenset(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # started and spinning
        before = read_sample(cpus)
        time.sleep(1.0)
        busy = others_cores(before, read_sample(cpus), len(cpus))  # type: ignore[arg-type]
    finally:
        spinner.kill()
        spinner.wait()
    assert busy >= 0.8  # one core's worth, less what the machine's scheduler gave others meanwhile
