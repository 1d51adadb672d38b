"""The one thread that owns the device: it drives the engine through the active requests' handles, a FIFO queue
behind them.

State machine per request (all under one lock; only this thread calls into the engine):
    submit → pending (told `queued` positions) → active (its pages reserved in the KV pool) → finished.
Each connection holds a generator handle on the shared engine (webchat.engine.engine). The thread visits the active
handles in turn: begin_stream() on a new one, else stream(), which returns what the engine made for that handle since
its last visit and runs one engine step (one forward for every running sequence) when there is nothing. A request is
admitted while its pages (prompt + max_new_tokens, `pages.pages_for`) fit beside the active ones', so running
sequences never run out; pages of idle sessions are evicted by the pool, least recently used first. A handle stays
in `sessions` between turns for prefix reuse, closed (its pages released) when evicted past `max_sessions` or when the
connection goes. Neutral events (webchat.engine.events) go back to the event loop through
`loop.call_soon_threadsafe(job.deliver, event)`, in order; each transport formats them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from webchat.engine import events as ev
from webchat.engine.sequence import GenerationRequest, StartInfo, StreamResult
from webchat.serve.backend import Job, Snapshot

log = logging.getLogger("webchat.serve.worker")

class StreamingGenerator(Protocol):
    """The part of webchat.engine.generator.Generator the worker uses (docs/design.md)."""

    def begin_stream(self, request: GenerationRequest) -> StartInfo: ...
    def stream(self) -> StreamResult: ...
    def cancel(self) -> None: ...


class PagePlanner(Protocol):
    """The engine's page arithmetic (webchat.engine.engine.Engine), read from any thread."""

    @property
    def usable_pages(self) -> int: ...
    def pages_for(self, req: GenerationRequest) -> int: ...


def _close(gen: StreamingGenerator | None) -> None:
    close = getattr(gen, "close", None)  # webchat.engine.generator.Generator releases its pages; test doubles may not
    if close is not None:
        close()


@dataclass
class Session:
    """One connection's generator and KV cache; `gen` is built on the worker thread at first use."""

    key: Hashable
    gen: StreamingGenerator | None = None
    in_use: bool = False
    closed: bool = False


class Worker:
    """A Backend (webchat.serve.backend): schedules requests from many connections onto one device thread."""

    def __init__(
        self,
        new_generator: Callable[[], StreamingGenerator],
        id_to_text: Callable[[int], str],
        loop: asyncio.AbstractEventLoop,
        max_sessions: int,
        max_queue: int,
        pages: PagePlanner | None = None,
    ) -> None:
        if max_sessions < 1 or max_queue < 0:
            raise ValueError(f"need max_sessions >= 1 and max_queue >= 0, got {max_sessions} and {max_queue}")
        self._new_generator = new_generator
        self._id_to_text = id_to_text  # a stop token's display text, for `done.trigger`
        self._loop = loop
        self.max_sessions, self.max_queue = max_sessions, max_queue
        self._pages = pages
        self._reserved = 0  # pages reserved by active jobs
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._active: deque[Job] = deque()  # round-robin: the head is stepped next, then rotated to the back
        self._jobs: dict[Hashable, Job] = {}  # at most one request per connection
        self._sessions: OrderedDict[Hashable, Session] = OrderedDict()  # LRU order: oldest first
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="webchat-worker", daemon=True)

    # ------------------------------------------------------------ event-loop side (never blocks on the model)
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            for job in self._active:
                job.dropped = True
                if job.session is not None and job.session.gen is not None:
                    job.session.gen.cancel()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._cond:
            self._sessions.clear()

    def submit(self, job: Job) -> None:
        """Queue a request; replies `busy_connection` or `busy` through job.deliver when it cannot be taken."""
        with self._cond:
            if job.key in self._jobs:
                running = self._jobs[job.key].request_id
                self._post(job, ev.Failed("busy_connection",
                                          f"request {running!r} is still running on this connection"))
                return
            if len(self._active) >= self.max_sessions and len(self._pending) >= self.max_queue:
                self._post(job, ev.Failed("busy", (
                    f"the server is busy: {len(self._active)} requests running and {len(self._pending)} waiting "
                    f"(max {self.max_queue}); try again shortly")))
                return
            self._jobs[job.key] = job
            job.pages = self._pages.pages_for(job.request) if self._pages is not None else 0
            self._pending.append(job)
            self._admit_locked()
            self._cond.notify_all()

    def cancel(self, key: Hashable, request_id: str) -> None:
        """`stop`: a queued request ends now, a running one at its next step; both answer `done` cancelled."""
        with self._cond:
            job = self._jobs.get(key)
            if job is None or job.request_id != request_id:
                return
            if job in self._pending:
                self._pending.remove(job)
                del self._jobs[key]
                self._post(job, cancelled(job))
                self._admit_locked()
                return
            job.cancel_requested = True
            if job.started and job.session is not None and job.session.gen is not None:
                job.session.gen.cancel()  # also interrupts a prefill in progress

    def close(self, key: Hashable) -> None:
        """The connection is gone: drop its request (queued or running) and free its KV cache."""
        with self._cond:
            job = self._jobs.get(key)
            if job is not None:
                job.dropped = True
                if job in self._pending:
                    self._pending.remove(job)
                    del self._jobs[key]
                elif job.session is not None and job.session.gen is not None:
                    job.session.gen.cancel()
            session = self._sessions.get(key)
            if session is not None:
                session.closed = True
                if not session.in_use:
                    del self._sessions[key]
                    _close(session.gen)
            self._admit_locked()
            self._cond.notify_all()

    def snapshot(self) -> Snapshot:
        with self._cond:
            return Snapshot([j.request_id for j in self._active], [j.request_id for j in self._pending],
                            len(self._sessions))

    # ------------------------------------------------------------ scheduling (lock held)
    def _post(self, job: Job, event: ev.Event) -> None:
        if job.dropped:
            return
        try:
            self._loop.call_soon_threadsafe(job.deliver, event)
        except RuntimeError:  # the loop has closed: shutting down
            pass

    def _admit_locked(self) -> None:
        """Move pending jobs into free slots (FIFO), then tell the ones still waiting their new positions."""
        while self._pending and len(self._active) < self.max_sessions and self._fits(self._pending[0]):
            job = self._pending.popleft()
            job.session = self._claim_session(job.key)
            self._reserved += job.pages
            self._active.append(job)
        for index, job in enumerate(self._pending):
            if job.position != index + 1:
                job.position = index + 1
                self._post(job, ev.Queued(job.position))

    def _fits(self, job: Job) -> bool:
        """Its pages fit beside the active jobs' (a job alone always runs: its pages are capped at the pool's)."""
        return self._pages is None or not self._active or self._reserved + job.pages <= self._pages.usable_pages

    def _claim_session(self, key: Hashable) -> Session:
        session = self._sessions.get(key)
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                idle = next(k for k, s in self._sessions.items() if not s.in_use)  # exists: fewer active than slots
                _close(self._sessions.pop(idle).gen)
            session = self._sessions[key] = Session(key)
        self._sessions.move_to_end(key)
        session.in_use = True
        return session

    def _finish_locked(self, job: Job) -> None:
        if job in self._active:
            self._active.remove(job)
            self._reserved -= job.pages
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        session = job.session
        if session is not None:
            session.in_use = False
            if self._sessions.get(job.key) is session:
                if session.closed:
                    del self._sessions[job.key]
                    _close(session.gen)
                else:
                    self._sessions.move_to_end(job.key)  # LRU by last use
        self._admit_locked()

    # ------------------------------------------------------------ the device thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._active and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._active[0]
                self._active.rotate(-1)
            try:
                self._step(job)
            except Exception as exc:  # a bug or a device error: this request ends, the server keeps serving
                log.exception("request %r failed", job.request_id)
                with self._cond:
                    if job.session is not None:
                        _close(job.session.gen)  # its sequence leaves the engine, its pages go back
                        job.session.gen = None
                    self._finish_locked(job)
                    self._post(job, ev.Failed("internal", f"generation failed: {type(exc).__name__}: {exc}"))

    def _step(self, job: Job) -> None:
        """One unit of work for `job`: build its handle, or join the engine (begin_stream), or one stream() step."""
        session = job.session
        assert session is not None
        if job.dropped or (job.cancel_requested and not job.started):
            with self._cond:
                self._finish_locked(job)
                self._post(job, cancelled(job))
            return
        if session.gen is None:
            session.gen = self._new_generator()
        gen = session.gen
        if not job.started:
            with self._cond:
                job.started = True
            info = gen.begin_stream(job.request)
            self._post_locked_free(job, ev.Started(info.prompt_tokens, info.reused_tokens))
            return
        if job.cancel_requested:
            gen.cancel()
        result = gen.stream()
        events = result_events(result, self._id_to_text)
        if result.eos:
            with self._cond:
                self._finish_locked(job)  # the slot is free before the client sees `done`
        for event in events:
            self._post_locked_free(job, event)

    def _post_locked_free(self, job: Job, event: ev.Event) -> None:
        with self._cond:
            self._post(job, event)


# ---------------------------------------------------------------- generator results → neutral events
def result_events(result: StreamResult, id_to_text: Callable[[int], str]) -> list[ev.Event]:
    """One StreamResult as `Tokens` (when it carries text or tokens) and, at its end, `Finished`."""
    out: list[ev.Event] = []
    if result.text or result.tokens:
        out.append(ev.Tokens(result.text, list(result.tokens)))
    if result.eos:
        trigger = result.eos_trigger
        out.append(ev.Finished(result.eos_reason or "", id_to_text(trigger) if isinstance(trigger, int) else trigger,
                               result.stats or ev.Stats()))
    return out


def cancelled(job: Job) -> ev.Finished:
    """`Finished` for a request stopped before it produced anything."""
    return ev.Finished("cancelled", None, ev.Stats(prompt_tokens=job.prompt_tokens))
