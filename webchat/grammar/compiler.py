"""Where grammars are built: off the event loop, on threads with a known 256 MiB stack, below the device thread's
priority, with a deadline.

    result = await compiler().run(build, *args)   # GrammarError on a deadline or a full queue; build's own errors

llguidance compiles by recursion; a thread of the default 8 MiB stack dies (SIGSEGV, the whole server with it) near
2,000 nested `$ref`s, where a 256 MiB stack holds 30 times that, more than the largest schema a request may send
spells out (webchat.grammar.bounds keeps every grammar far below either). Only touched stack pages are memory. The
threads run at nice +10: on a 2-core machine a schema's compile then takes CPU the device's forward leaves, so other
clients' streams keep their pace while it runs. A compile past DEADLINE_S answers its request with an error naming
the deadline (its thread finishes on its own; the library's fuel bounds how long that takes).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from webchat.grammar.bounds import GrammarError

T = TypeVar("T")
log = logging.getLogger("webchat.grammar")

STACK_BYTES = 256 << 20
THREADS = 2
NICE = 10
DEADLINE_S = 10.0  # a schema of 256 KiB compiles in ~0.3 s on a quiet 2-core machine
_STACK_LOCK = threading.Lock()


def start_thread(target: Callable[[], None], name: str, stack: int) -> threading.Thread:
    """A daemon thread whose stack is `stack` bytes (threading.stack_size is process-wide: set, start, restore)."""
    with _STACK_LOCK:
        previous = threading.stack_size(stack)
        try:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    return thread


def lower_priority(nice: int) -> None:
    """The calling thread's nice value raised by `nice` (Linux schedules threads alone; elsewhere a no-op)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
    except (OSError, AttributeError):
        pass


class Compiler:
    """THREADS threads with a STACK_BYTES stack at nice +NICE, fed by one queue."""

    def __init__(self, threads: int = THREADS, stack: int = STACK_BYTES, deadline: float = DEADLINE_S) -> None:
        self.deadline = deadline
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._threads = [start_thread(self._serve, f"webchat-grammar-{i}", stack) for i in range(threads)]

    def _serve(self) -> None:
        lower_priority(NICE)
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the awaiting request
                future.set_exception(exc)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a compiler thread; GrammarError when it has not ended within the deadline."""
        future: Future[T] = Future()
        self._jobs.put((functools.partial(fn, *args), future))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.deadline)
        except TimeoutError:
            future.cancel()  # not started yet: it never runs; running: it ends on its own, its result unread
            log.warning("a grammar took more than %g s to compile; its request was refused", self.deadline)
            raise GrammarError(f"compiling the grammar took more than {self.deadline:g} s; simplify it") from None

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a compiler thread, waited for from a thread that is not the event loop (tests, CLIs)."""
        future: Future[T] = Future()
        self._jobs.put((functools.partial(fn, *args), future))
        return future.result(self.deadline)


_COMPILER: Compiler | None = None
_COMPILER_LOCK = threading.Lock()


def compiler() -> Compiler:
    """The process's compiler threads, started on first use."""
    global _COMPILER
    with _COMPILER_LOCK:
        if _COMPILER is None:
            _COMPILER = Compiler()
        return _COMPILER
