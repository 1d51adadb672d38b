"""Incremental detokenisation: token ids in, text out, a character split over byte tokens given to the last one."""

from __future__ import annotations

import codecs
from collections.abc import Callable


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces using `token_bytes(id) -> bytes`.

    `push(id)` returns the text this token completes: "" while a UTF-8 sequence is still open, the whole character
    on the token that closes it. Valid UTF-8 never yields U+FFFD; bytes that can never be valid (a stray continuation
    byte) yield one U+FFFD each, as Python's "replace" does. `finish()` drops an unfinished trailing sequence
    (the reply was cut mid-character) instead of emitting U+FFFD.
    """

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._memo: dict[int, bytes] = {}
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def bytes_of(self, token: int) -> bytes:
        b = self._memo.get(token)
        if b is None:
            b = self._memo[token] = self._token_bytes(token)
        return b

    def push(self, token: int) -> str:
        return self._utf8.decode(self.bytes_of(token))

    def pending(self) -> bytes:
        """Bytes of an unfinished character held inside the decoder."""
        return self._utf8.getstate()[0]

    def finish(self) -> bytes:
        """End of stream: drop an unfinished trailing character (the reply was cut inside it); returns its bytes."""
        dropped = self.pending()
        self._utf8.reset()
        return dropped


def decode_all(token_bytes: Callable[[int], bytes], ids: list[int]) -> str:
    """Reference: the text of a whole id list, decoded at once (same rules as IncrementalDecoder)."""
    dec = IncrementalDecoder(token_bytes)
    return "".join(dec.push(t) for t in ids)
