"""The local Backend (webchat.serve.backend): requests from every connection queued fairly, the engine stepped on the
device thread, and each step's results delivered to their requests.

    submit → waiting (per client, told `queued` positions) → running (a sequence in the engine) → finished

The device thread (webchat.serve.device) loops `admit → engine.step() → deliver` (exllamav2's iterate() with
dynamic_async's per-job queues; nano-vllm's schedule → run → postprocess): no request ever steps the engine for the
others, and a Stop costs no step of its own (the engine ends a cancelled sequence at its next step, before the
forward). The engine alone decides whether a request's pages fit (Engine.fits); pages grow as sequences generate and
the newest is preempted and recomputed when the pool runs out, so a missing max_tokens does not reserve the context.

Admission is fair and bounded whatever limits it: waiting requests are kept per client (a websocket connection, an
API key, or a peer address), at most `per_client` each, and the next free slot goes to the client served least
recently (a newcomer first); at most `max_queue` wait beyond the free slots (none are free while pages block
admission), so a flooder waits behind its own requests and gets `busy` past that. A connection's engine owner stays
between turns for prefix reuse, at most `max_sessions` of them, the least recently used idle one closed first.
Neutral events (webchat.engine.events) go back to the event loop through `loop.call_soon_threadsafe(job.deliver, ...)`.

A stream's tokens are sent at most every `stream_interval` seconds while they come faster than that (SGLang's
`--stream-interval`, counted in time rather than tokens): the engine keeps merging a sequence's results until the next
send is due, so a fast small model wakes the event loop, the socket and the client once for several tokens instead of
for each. Every wakeup preempts one of the forward's threads on a small machine (issue 20). A result waits only where
the next step is expected to end before its interval does, never behind a prefill or an admission, and a stream's first
token and its end go out at once; tokens slower than the interval go out one by one as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Protocol

from webchat.engine import events as ev
from webchat.engine.sequence import GenerationRequest, Sequence, StartInfo, StreamResult
from webchat.serve.backend import Job, Snapshot
from webchat.serve.device import DeviceThread

log = logging.getLogger("webchat.serve.worker")

PER_CLIENT = 4  # requests one client may have waiting
SERVED_MEMORY = 4096  # clients whose last admission is remembered for round-robin


class Engine(Protocol):
    """What the worker uses of webchat.engine.engine.Engine (all called on the device thread, except close)."""

    @property
    def running(self) -> list[Sequence]: ...

    def fits(self, req: GenerationRequest) -> bool: ...
    def add(self, owner: object, req: GenerationRequest) -> tuple[Sequence, StartInfo]: ...
    def step(self) -> None: ...
    def take(self, seq: Sequence) -> StreamResult | None: ...
    def close(self, owner: object) -> None:
        """Thread-safe."""


class Worker:
    """Schedules requests from many connections onto one engine, stepped on the device thread."""

    def __init__(self, engine: Engine, id_to_text: Callable[[int], str], loop: asyncio.AbstractEventLoop,
                 max_sessions: int, max_queue: int, device: DeviceThread | None = None,
                 per_client: int = PER_CLIENT, stream_interval: float = 0.0) -> None:
        if max_sessions < 1 or max_queue < 0 or per_client < 1 or not stream_interval >= 0:
            raise ValueError(f"need max_sessions >= 1, max_queue >= 0, per_client >= 1 and stream_interval >= 0, got "
                             f"{max_sessions}, {max_queue}, {per_client} and {stream_interval}")
        self.engine = engine
        self._id_to_text = id_to_text  # a stop token's display text, for `done.trigger`
        self._loop = loop
        self.max_sessions, self.max_queue, self.per_client = max_sessions, max_queue, per_client
        self.device = device if device is not None else DeviceThread()
        self._cond = self.device.cond
        self._waiting: dict[Hashable, deque[Job]] = {}  # client -> its waiting jobs, oldest first
        self._served: OrderedDict[Hashable, int] = OrderedDict()  # client -> when it last got a slot, oldest first
        self._tick = 0
        self._active: list[Job] = []
        self._jobs: dict[Hashable, Job] = {}  # at most one request per connection
        self._owners: OrderedDict[Hashable, object] = OrderedDict()  # connection -> its engine owner, LRU first
        self._page_blocked = False  # the head of the queue did not fit the pool at the last admission
        self._stopping = False
        self.stream_interval = stream_interval
        self._last_step_end: float | None = None  # perf_counter at the end of the last engine step

    # ------------------------------------------------------------ event-loop side (never blocks on the model)
    def start(self) -> None:
        self.device.start()
        self.device.drive(self)

    def stop(self, timeout: float = 10.0) -> None:
        self.halt()
        self.device.drive(None)
        self.device.stop(timeout)

    def halt(self) -> None:
        """No more work: running requests are dropped (their sequences cancelled), waiting ones too; the device
        thread goes on (webchat.serve.models.Fleet unloads one model's worker this way)."""
        with self._cond:
            self._stopping = True
            for job in self._active:
                job.dropped = True
                if job.seq is not None:
                    job.seq.cancel.set()
            self._cond.notify_all()

    def submit(self, job: Job) -> None:
        """Queue a request; replies `busy_connection` or `busy` through job.deliver when it cannot be taken."""
        with self._cond:
            if job.key in self._jobs:
                running = self._jobs[job.key].request_id
                self._post(job, ev.Failed("busy_connection",
                                          f"request {running!r} is still running on this connection"))
                return
            waiting = sum(len(q) for q in self._waiting.values())
            free = 0 if self._page_blocked else max(0, self.max_sessions - len(self._active))
            mine = self._waiting.get(job.client)
            if waiting >= free and mine is not None and len(mine) >= self.per_client:  # it would have to wait
                self._post(job, ev.Failed("busy", (
                    f"this client already has {len(mine)} requests waiting (at most {self.per_client} per client); "
                    "try again when one has started")))
                return
            if waiting >= self.max_queue + free:
                self._post(job, ev.Failed("busy", (
                    f"the server is busy: {len(self._active)} requests running and {waiting} waiting "
                    f"(max {self.max_queue}); try again shortly")))
                return
            self._jobs[job.key] = job
            self._waiting.setdefault(job.client, deque()).append(job)
            if waiting >= free:  # no slot for it at the next admission: it waits, and is told where it stands
                self._tell_positions()
            self._cond.notify_all()

    def cancel(self, key: Hashable, request_id: str) -> None:
        """`stop`: a queued request ends now, a running one at the engine's next step; both answer `done` cancelled."""
        with self._cond:
            job = self._jobs.get(key)
            if job is None or job.request_id != request_id:
                return
            if self._unqueue(job):
                del self._jobs[key]
                self._post(job, cancelled(job))
                self._tell_positions()
                return
            job.cancel_requested = True
            if job.seq is not None:
                job.seq.cancel.set()  # also interrupts a prefill in progress, between chunks
            self._cond.notify_all()

    def close(self, key: Hashable) -> None:
        """The connection is gone: drop its request (queued or running) and free its KV cache."""
        with self._cond:
            job = self._jobs.get(key)
            if job is not None:
                job.dropped = True
                if self._unqueue(job):
                    del self._jobs[key]
                    self._tell_positions()
                elif job.seq is not None:
                    job.seq.cancel.set()
            owner = self._owners.pop(key, None)
            if owner is not None:
                self.engine.close(owner)  # its running sequence ends and its pages go back at the next step
            self._cond.notify_all()

    def snapshot(self) -> Snapshot:
        with self._cond:
            return Snapshot([j.request_id for j in self._active], [j.request_id for j in self._order()],
                            len(self._owners))

    # ------------------------------------------------------------ the device thread (webchat.serve.device.Driver)
    def has_work(self) -> bool:
        return not self._stopping and bool(self._active or self._waiting)

    def iterate(self) -> None:
        """Admit what fits, run one engine step, deliver every sequence's results."""
        with self._cond:
            self._admit()
            for job in self._active:
                if (job.cancel_requested or job.dropped) and job.seq is not None:
                    job.seq.cancel.set()
        if not self.engine.running:
            self._last_step_end = None
            return
        try:
            self.engine.step()
        except Exception as exc:  # a bug or a device error: the step's requests end, the server keeps serving
            log.exception("engine step failed")
            with self._cond:
                for job in list(self._active):
                    self._fail(job, ev.Failed("internal", f"generation failed: {type(exc).__name__}: {exc}"))
            return
        now = time.perf_counter()
        # when the next step's results would go out: one more cycle as long as the last (other models' steps and the
        # admission included); none where the next step prefills or may admit someone (its length is not known)
        cycle = now - self._last_step_end if self._last_step_end is not None else float("inf")
        self._last_step_end = now
        with self._cond:
            next_out = now + cycle
            may_admit = self._waiting and not self._page_blocked and len(self._active) < self.max_sessions
            if may_admit or any(s.prefilling for s in self.engine.running):
                next_out = float("inf")
            for job in list(self._active):
                assert job.seq is not None
                if job.next_send > next_out and not job.seq.done:
                    continue  # held: the engine merges this step's tokens with the next's
                res = self.engine.take(job.seq)
                if res is None:
                    if job.seq.done:  # its owner was closed: the engine dropped it with its results
                        self._finish(job)
                    continue
                if res.eos:
                    self._finish(job)  # the slot is free before the client sees `done`
                job.next_send = now + self.stream_interval
                for event in result_events(res, self._id_to_text):
                    self._post(job, event)

    # ------------------------------------------------------------ scheduling (lock held)
    def _post(self, job: Job, event: ev.Event) -> None:
        if job.dropped:
            return
        try:
            self._loop.call_soon_threadsafe(job.deliver, event)
        except RuntimeError:  # the loop has closed: shutting down
            pass

    def _order(self) -> list[Job]:
        """Waiting jobs in the order they would be admitted: round-robin over clients, least recently served first."""
        queues = [self._waiting[c] for c in sorted(self._waiting, key=lambda c: self._served.get(c, -1))]
        out: list[Job] = []
        for depth in range(max((len(q) for q in queues), default=0)):
            out += [q[depth] for q in queues if len(q) > depth]
        return out

    def _tell_positions(self) -> None:
        for index, job in enumerate(self._order()):
            if job.position != index + 1:
                job.position = index + 1
                self._post(job, ev.Queued(job.position))

    def _unqueue(self, job: Job) -> bool:
        queue = self._waiting.get(job.client)
        if queue is None or job not in queue:
            return False
        queue.remove(job)
        if not queue:
            del self._waiting[job.client]
        return True

    def _admit(self) -> None:
        """Fill free slots from the waiting queues while the engine says the next request's pages fit."""
        self._page_blocked = False
        while self._waiting and len(self._active) < self.max_sessions:
            client = min(self._waiting, key=lambda c: self._served.get(c, -1))
            job = self._waiting[client][0]
            if job.dropped or job.cancel_requested:
                self._unqueue(job)
                self._jobs.pop(job.key, None)
                self._post(job, cancelled(job))
                continue
            if not self.engine.fits(job.request):
                self._page_blocked = True
                break
            self._unqueue(job)
            self._tick += 1
            self._served[client] = self._tick
            self._served.move_to_end(client)
            while len(self._served) > SERVED_MEMORY:  # clients not seen for long count as new again
                self._served.popitem(last=False)
            try:
                seq, info = self.engine.add(self._owner(job.key), job.request)
            except Exception as exc:  # a request the engine refuses (front ends check first): it alone fails
                log.exception("request %r could not start", job.request_id)
                self._jobs.pop(job.key, None)
                self._post(job, ev.Failed("internal", f"generation failed: {type(exc).__name__}: {exc}"))
                continue
            job.seq, job.started = seq, True
            self._active.append(job)
            self._post(job, ev.Started(info.prompt_tokens, info.reused_tokens))
        self._tell_positions()

    def _owner(self, key: Hashable) -> object:
        """The connection's engine owner (its pages stay between turns); past max_sessions the least recently used
        idle one is closed."""
        owner = self._owners.get(key)
        if owner is None:
            if len(self._owners) >= self.max_sessions:
                busy = {j.key for j in self._active}
                idle = next((k for k in self._owners if k not in busy), None)
                if idle is not None:
                    self.engine.close(self._owners.pop(idle))
            owner = self._owners[key] = object()
        self._owners.move_to_end(key)
        return owner

    def _finish(self, job: Job) -> None:
        if job in self._active:
            self._active.remove(job)
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        if job.key in self._owners:
            self._owners.move_to_end(job.key)

    def _fail(self, job: Job, failure: ev.Failed) -> None:
        self._finish(job)
        owner = self._owners.pop(job.key, None)
        if owner is not None:
            self.engine.close(owner)  # its sequence leaves the engine, its pages go back
        self._post(job, failure)


# ---------------------------------------------------------------- engine results → neutral events
def result_events(result: StreamResult, id_to_text: Callable[[int], str]) -> list[ev.Event]:
    """One StreamResult as `PromptTokens` (a scored prompt), `Tokens` (when it carries text or tokens) and, at its
    end, `Finished` (or `Failed` where the engine ended it with an error: a grammar that could not go on)."""
    out: list[ev.Event] = []
    if result.prompt is not None:
        out.append(ev.PromptTokens(result.prompt))
    if result.text or result.tokens:
        out.append(ev.Tokens(result.text, list(result.tokens)))
    if result.eos and result.error is not None:
        out.append(ev.Failed(*result.error))
    elif result.eos:
        trigger = result.eos_trigger
        out.append(ev.Finished(result.eos_reason or "", id_to_text(trigger) if isinstance(trigger, int) else trigger,
                               result.stats or ev.Stats(), result.stop_info))
    return out


def cancelled(job: Job) -> ev.Finished:
    """`Finished` for a request stopped before it produced anything."""
    return ev.Finished("cancelled", None, ev.Stats(prompt_tokens=job.prompt_tokens))
