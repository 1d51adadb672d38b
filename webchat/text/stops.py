"""Stop strings: hold back text that could start one, so that no part of a stop string ever reaches the caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Released(Generic[T]):
    """What may be shown now: `text` == "".join(piece for _, piece in items); `stop` the string that matched."""

    text: str = ""
    items: list[tuple[T, str]] = field(default_factory=list)
    stop: str | None = None


class StopHolder(Generic[T]):
    """Feeds (token, piece) pairs; releases whole tokens once their text cannot be part of a stop string.

    Text is held from the start of the token holding the earliest position whose suffix is a prefix of some stop
    string. When a stop string appears (across tokens, or inside one token with text after it) everything before it
    is released, the token that straddles it gets the part before it as its piece, and the rest is dropped.
    """

    def __init__(self, stop_strings: list[str]) -> None:
        for s in stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stops = list(dict.fromkeys(stop_strings))
        self._longest = max((len(s) for s in self.stops), default=0)
        self._pending: list[tuple[T, str]] = []
        self._held = ""  # == "".join(piece for _, piece in self._pending)
        self.stopped: str | None = None

    def push(self, item: T, piece: str) -> Released[T]:
        if self.stopped is not None:
            raise RuntimeError(f"push after the stop string {self.stopped!r} matched")
        self._pending.append((item, piece))
        self._held += piece
        if not self.stops:
            return self._release(len(self._held))
        hit = self._first_stop()
        if hit is not None:
            return self._cut(*hit)
        return self._release(self._hold_start())

    def flush(self) -> Released[T]:
        """The stream ended another way: everything held is ordinary text."""
        return self._release(len(self._held))

    def _first_stop(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stops:
            p = self._held.find(s)
            if p >= 0 and (best is None or p < best[0]):
                best = (p, s)
        return best

    def _hold_start(self) -> int:
        """Earliest index i with held[i:] a proper prefix of a stop string; len(held) when none."""
        held = self._held
        for i in range(max(0, len(held) - self._longest + 1), len(held)):
            tail = held[i:]
            if any(s.startswith(tail) for s in self.stops):
                return i
        return len(held)

    def _release(self, upto: int) -> Released[T]:
        """Release the leading pending tokens whose pieces end at or before char `upto` of the held text."""
        out: Released[T] = Released()
        end = 0
        n = 0
        for _, piece in self._pending:
            if end + len(piece) > upto:
                break
            end += len(piece)
            n += 1
        out.items, self._pending = self._pending[:n], self._pending[n:]
        out.text, self._held = self._held[:end], self._held[end:]
        return out

    def _cut(self, pos: int, stop: str) -> Released[T]:
        """A stop string starts at char `pos` of the held text: keep what precedes it, drop the rest."""
        out: Released[T] = Released(stop=stop)
        start = 0
        for item, piece in self._pending:
            if start >= pos:
                break
            out.items.append((item, piece[: pos - start]))
            start += len(piece)
        out.text = self._held[:pos]
        self._pending, self._held, self.stopped = [], "", stop
        return out
