"""The one compute pool: a single long-lived thread that does everything parallel on the CPU (or launches on the GPU)
for the server: loading and warming the model, every engine step, sampling.

Why a thread and not a pool of our own: torch's OpenMP team belongs to the thread that first enters a parallel
region, and a second thread entering one gets a second team. When the model was loaded and warmed on one thread and
stepped on another, the process held two teams on 2 cores and every barrier of the ~150 parallel regions a token
waited on the other team's spinning threads: a single stream decoded at a third of the bare forward's speed
(issue 20). Running everything on one thread keeps one team, warm, with no change to the kernels; llama.cpp's
persistent ggml threadpool reaches the same end from the other side.

    device = DeviceThread(); device.start()                      # threads=N: a team of N, not following the load
    runtime = await device.run(lambda: load_runtime(config))    # from the event loop: awaits, never blocks it
    device.drive(worker)                                         # worker.has_work() / worker.iterate() in between

The team's size follows what other processes leave of the cores (webchat.serve.cores), checked between iterations.

`cond` is the lock the driver (webchat.serve.worker.Worker) shares, so "is there work" and "wait for work" cannot race.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, TypeVar

from webchat.serve.cores import CoreGovernor

log = logging.getLogger("webchat.serve.device")

T = TypeVar("T")


class Driver(Protocol):
    def has_work(self) -> bool:
        """Called with `cond` held."""

    def iterate(self) -> None:
        """One round of work (admit, step, deliver), called without `cond` held."""


class DeviceThread:
    """Runs submitted calls and, between them, the driver's iterations; all on one thread (`ident`)."""

    def __init__(self, threads: int | None = None, name: str = "webchat-device",
                 governor: Callable[[int], CoreGovernor] = CoreGovernor) -> None:
        self.cond = threading.Condition()
        self.threads = threads
        self._make_governor = governor  # given the most threads the team may have (torch's default count)
        self.governor: CoreGovernor | None = None  # set on the thread when threads is None
        self.ident: int | None = None
        self._calls: deque[tuple[Callable[[], object], Future[object]]] = deque()
        self._driver: Driver | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def team(self) -> dict[str, object]:
        """The OpenMP team now: its size, the most it may have, whether it follows the load, the others' share."""
        import torch

        gov = self.governor
        if gov is None or not gov.enabled:
            return {"threads": self.threads or torch.get_num_threads(), "adaptive": False}
        return {"threads": gov.threads, "most": gov.most, "adaptive": True, "others_busy_cores": round(gov.others, 2)}

    def start(self) -> None:
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the device thread; its result or exception comes back through the future."""
        fut: Future[T] = Future()
        with self.cond:
            if self._stopping:
                raise RuntimeError("the device thread has stopped")
            self._calls.append((fn, fut))  # type: ignore[arg-type]
            self.cond.notify_all()
        return fut

    async def run(self, fn: Callable[[], T]) -> T:
        """From the event loop: await fn run on the device thread."""
        return await asyncio.wrap_future(self.call(fn))

    def drive(self, driver: Driver | None) -> None:
        with self.cond:
            self._driver = driver
            self.cond.notify_all()

    def stop(self, timeout: float = 10.0) -> None:
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        if self._thread.is_alive() and threading.get_ident() != self._thread.ident:
            self._thread.join(timeout)

    def _run(self) -> None:
        self.ident = threading.get_ident()
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)  # this thread's team is the one every forward uses
        else:
            self.governor = self._make_governor(torch.get_num_threads())
            torch.set_num_threads(self.governor.threads)  # the team starts as the governor counts it
        while True:
            with self.cond:
                while not self._stopping and not self._calls and not (self._driver and self._driver.has_work()):
                    self.cond.wait()
                if self._stopping:
                    calls = list(self._calls)
                    self._calls.clear()
                    for _, fut in calls:
                        fut.cancel()
                    return
                calls = list(self._calls)
                self._calls.clear()
                driver = self._driver
            if self.governor is not None and (team := self.governor.poll()) is not None:
                torch.set_num_threads(team)  # between parallel regions: the next one runs on the new team
            for fn, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(exc)
            if driver is not None:
                try:
                    driver.iterate()
                except Exception:  # the driver reports its own failures; this keeps the thread alive regardless
                    log.exception("device loop iteration failed")
