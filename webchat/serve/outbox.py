"""A connection's replies waiting for its socket: merged chunks, a byte cap (backpressure), a bound on error replies,
and a clock on the write in progress (a peer that never reads)."""

from __future__ import annotations

import asyncio
import time

from webchat.serve import protocol as p

MAX_PENDING_ERRORS = 32  # error replies waiting at once on a connection; more are dropped (a flood of bad frames)


def _size(msg: p.ServerMessage) -> int:
    """Bytes the message will take on the wire, estimated for chunks (a token entry: 64 bytes + 48 per alternative)."""
    if isinstance(msg, p.Chunk):
        return 64 + len(msg.text.encode()) + sum(64 + 48 * len(t.top) for t in msg.tokens or [])
    return len(p.dump(msg))


class Outbox:
    """Messages waiting for the socket; a chunk that follows a chunk of the same request merges into it.

    `pending` counts their bytes; past `max_bytes` the connection stops reading frames (`room()` waits), so a client
    that sends without reading holds at most about max_bytes of replies, never more.
    """

    def __init__(self, max_bytes: int = 1 << 20) -> None:
        self._items: list[p.ServerMessage] = []
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self.max_bytes = max_bytes
        self.pending = 0
        self.errors = 0  # error replies waiting
        self.dropped_errors = 0
        self.merged = 0  # how many chunks were coalesced (a slow reader)

    def push(self, msg: p.ServerMessage) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(msg, p.Error):
            if msg.id is None and self.errors >= MAX_PENDING_ERRORS:
                self.dropped_errors += 1
                return
            self.errors += 1
        if isinstance(msg, p.Chunk) and isinstance(last, p.Chunk) and last.id == msg.id:
            self._items[-1] = last.merged(msg)
            self.pending += _size(self._items[-1]) - _size(last)
            self.merged += 1
        else:
            self._items.append(msg)
            self.pending += _size(msg)
        if self.pending > self.max_bytes:
            self._room.clear()
        self._ready.set()

    async def take(self) -> list[p.ServerMessage]:
        await self._ready.wait()
        self._ready.clear()
        items, self._items = self._items, []
        return items

    def sent(self, msg: p.ServerMessage) -> None:
        """One taken message is written: its bytes no longer count."""
        self.pending = max(0, self.pending - _size(msg))
        self.errors -= isinstance(msg, p.Error)
        if self.pending <= self.max_bytes:
            self._room.set()

    async def room(self, timeout: float | None = None) -> bool:
        """Wait until the pending output is under the cap; False if it stayed over it for `timeout` seconds."""
        if self._room.is_set():
            return True
        try:
            await asyncio.wait_for(self._room.wait(), timeout)
        except TimeoutError:
            return False
        return True


class SendClock:
    """When the socket write in progress began (None: none is): a write that does not end means the peer does not
    read."""

    def __init__(self) -> None:
        self.since: float | None = None

    def stalled(self, timeout: float) -> bool:
        return self.since is not None and time.monotonic() - self.since > timeout
