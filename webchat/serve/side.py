"""Work beside the device thread that must not take its cores: a thread at nice +10 whose OpenMP parallel regions run
on itself alone (loading and converting a model while other models stream).

    loader = SideThread("webchat-loader")
    runtime = await loader.run(load)     # from the event loop

torch's OpenMP team belongs to the thread that first enters a parallel region (webchat.serve.device): a load on a
second thread with the default thread count would start a second team of two on a 2-core machine, and both teams
would spin at every barrier. Here the thread's own OpenMP thread count is 1 (the ICV is per thread: the device
thread keeps its team), so the load's parallel loops run serially beside the streams, at a priority that leaves the
device its cores.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import queue
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from webchat.grammar.compiler import NICE, lower_priority, start_thread

T = TypeVar("T")
log = logging.getLogger("webchat.serve.side")

STACK_BYTES = 64 << 20


def one_openmp_thread() -> bool:
    """Parallel regions entered from the calling thread run on it alone; False where libgomp is not found."""
    import torch

    torch.get_num_threads()  # torch's per-thread lazy init first (it would set the thread count back)
    try:
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(1)
    except (OSError, AttributeError):
        return False
    return torch.get_num_threads() == 1


class SideThread:
    """One thread at nice +NICE with one OpenMP thread, fed by a queue, started on first use."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._started = False

    def _serve(self) -> None:
        lower_priority(NICE)
        if not one_openmp_thread():
            log.info("%s: libgomp not found; its parallel loops use the default thread count", self.name)
        while True:
            fn, future = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the awaiting caller
                    future.set_exception(exc)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the side thread, awaited."""
        if not self._started:
            start_thread(self._serve, self.name, STACK_BYTES)
            self._started = True
        future: Future[T] = Future()
        self._jobs.put((functools.partial(fn, *args), future))
        return await asyncio.wrap_future(future)
