"""Streaming one API request: its worker events on the event loop (Pending) and its Server-Sent Events body.

    submit → Pending.next() → [Queued*, Started, Tokens*, Finished | Failed]   (GONE once the client left)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from webchat.engine import events as ev
from webchat.serve.backend import Backend
from webchat.serve.openai.format import DONE, Reply, error_chunk, merge, sse

FAILED_STATUS = {"busy": 429, "shutting_down": 503, "internal": 500, "upstream": 502, "model_busy": 429, "grammar": 400}
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
GONE = None  # in a Pending queue: the client disconnected


class Pending:
    """One request's worker events on the event loop, in order; GONE once its client disconnected."""

    def __init__(self, worker: Backend) -> None:
        self.worker = worker
        self.key = object()  # the worker's session key: one per API request, closed when it ends
        self.queue: asyncio.Queue[ev.Event | None] = asyncio.Queue()

    def deliver(self, event: ev.Event) -> None:
        self.queue.put_nowait(event)

    async def next(self) -> list[ev.Event | None]:
        """Wait for one event, then take every one already waiting (merged: a slow reader gets larger chunks)."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        events = [e for e in items if e is not None]
        return [*merge(events), *([GONE] if len(events) < len(items) else [])]

    async def watch(self, receive: Receive) -> None:
        """Await the client's disconnect; then drop the job (queued or running: it ends at its next step)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.worker.close(self.key)
        self.queue.put_nowait(GONE)

    def end(self, watcher: asyncio.Task[None]) -> None:
        watcher.cancel()
        self.worker.close(self.key)  # frees the session (its KV cache): API requests share no prefix cache


class EventStream(Response):
    """The SSE body of one request: chunks as the worker's events arrive, then `data: [DONE]`."""

    def __init__(self, pending: Pending, watcher: asyncio.Task[None], reply: Reply, first: list[ev.Event | None],
                 headers: dict[str, str], on_end: Callable[[Pending], None]) -> None:  # fmt: skip
        self.status_code, self.background = 200, None
        self.init_headers({**SSE_HEADERS, **headers})  # no body attribute: no Content-Length
        self.pending, self.watcher, self.reply, self.first, self.on_end = pending, watcher, reply, first, on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            role = self.reply.role_chunk()
            body, done = self._format(self.first)
            events = self.first
            body = (sse(role) if role else b"") + body
            while True:
                if GONE in events:
                    return  # nobody is reading; the job is already closed
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": not done})
                if done:
                    return
                events = await self.pending.next()
                body, done = self._format(events)
        finally:
            self.pending.end(self.watcher)
            self.on_end(self.pending)

    def _format(self, events: list[ev.Event | None]) -> tuple[bytes, bool]:
        out = b""
        for event in events:
            if isinstance(event, ev.Queued):
                out += f": queued, position {event.position}\n\n".encode()  # an SSE comment: clients skip it
            elif isinstance(event, ev.Tokens | ev.PromptTokens):
                chunk = self.reply.chunk(event) if isinstance(event, ev.Tokens) else self.reply.prompt(event)
                out += sse(chunk) if chunk else b""
            elif isinstance(event, ev.Finished):
                return out + b"".join(sse(c) for c in self.reply.finish_chunks(event)) + DONE, True
            elif isinstance(event, ev.Failed):
                return out + error_chunk(FAILED_STATUS.get(event.code, 400), event.message, event.code) + DONE, True
        return out, False
