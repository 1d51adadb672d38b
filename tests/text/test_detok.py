"""Incremental detokenisation: characters split over byte tokens belong to the token that completes them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from webchat.text.detok import IncrementalDecoder, decode_all


def _table(chunks: list[bytes]) -> dict[int, bytes]:
    return dict(enumerate(chunks))


def _byte_split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


def _owner_pieces(text: str, chunks: list[bytes]) -> list[str]:
    """Independent expectation: each character goes to the chunk holding its last byte."""
    ends = []
    total = 0
    for c in chunks:
        total += len(c)
        ends.append(total)
    pieces = [""] * len(chunks)
    pos = 0
    for ch in text:
        pos += len(ch.encode())
        owner = next(i for i, e in enumerate(ends) if e >= pos and (i == 0 or ends[i - 1] < pos))
        pieces[owner] += ch
    return pieces


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=30), cuts=st.lists(st.integers(0, 200), max_size=30))
def test_pieces_follow_the_completing_token(text: str, cuts: list[int]) -> None:
    chunks = _byte_split(text.encode(), cuts)
    table = _table(chunks)
    dec = IncrementalDecoder(table.__getitem__)
    pieces = [dec.push(i) for i in range(len(chunks))]
    assert pieces == _owner_pieces(text, chunks)
    assert "".join(pieces) == text
    assert dec.pending() == b""


def test_emoji_and_accents_split_byte_by_byte() -> None:
    text = "café 👍🏽 naïve"
    data = text.encode()
    table = {i: bytes([b]) for i, b in enumerate(data)}
    dec = IncrementalDecoder(table.__getitem__)
    pieces = [dec.push(i) for i in range(len(data))]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == text
    thumbs = data.index("👍".encode())
    assert pieces[thumbs : thumbs + 4] == ["", "", "", "👍"]


def test_cut_mid_character_drops_the_tail_without_replacement_char() -> None:
    table = {0: b"ok ", 1: "é".encode()[:1]}
    dec = IncrementalDecoder(table.__getitem__)
    assert dec.push(0) == "ok " and dec.push(1) == ""
    assert dec.finish() == "é".encode()[:1]
    assert dec.pending() == b""


def test_invalid_bytes_are_replaced_not_swallowed() -> None:
    table = {0: b"a\x80b"}
    assert decode_all(table.__getitem__, [0]) == "a\ufffdb"


def test_token_bytes_is_looked_up_once_per_id() -> None:
    calls: list[int] = []

    def token_bytes(i: int) -> bytes:
        calls.append(i)
        return b"x"

    dec = IncrementalDecoder(token_bytes)
    for _ in range(5):
        dec.push(7)
    assert calls == [7]
