"""The one compute pool: a single long-lived thread that does everything parallel on the CPU (or launches on the GPU)
for the server: loading and warming the model, every engine step, sampling.

Why a thread and not a pool of our own: torch's OpenMP team belongs to the thread that first enters a parallel
region, and a second thread entering one gets a second team. When the model was loaded and warmed on one thread and
stepped on another, the process held two teams on 2 cores and every barrier of the ~150 parallel regions a token
waited on the other team's spinning threads: a single stream decoded at a third of the bare forward's speed
(issue 20). Running everything on one thread keeps one team, warm, with no change to the kernels; llama.cpp's
persistent ggml threadpool reaches the same end from the other side.

    device = DeviceThread(threads=2); device.start()
    runtime = await device.run(lambda: load_runtime(config))    # from the event loop: awaits, never blocks it
    device.drive(worker)                                         # worker.has_work() / worker.iterate() in between

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

log = logging.getLogger("webchat.serve.device")

T = TypeVar("T")


class Driver(Protocol):
    def has_work(self) -> bool:
        """Called with `cond` held."""

    def iterate(self) -> None:
        """One round of work (admit, step, deliver), called without `cond` held."""


class DeviceThread:
    """Runs submitted calls and, between them, the driver's iterations; all on one thread (`ident`)."""

    def __init__(self, threads: int | None = None, name: str = "webchat-device") -> None:
        self.cond = threading.Condition()
        self.threads = threads
        self.ident: int | None = None
        self._calls: deque[tuple[Callable[[], object], Future[object]]] = deque()
        self._driver: Driver | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

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
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)  # this thread's team is the one every forward uses
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
