"""Stop strings: nothing of a stop string reaches the caller, whatever the token split."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from webchat.text.stops import StopHolder

ALPHABET = "ab\n<>/ é"


def _split(text: str, cuts: list[int]) -> list[str]:
    """Cut text at the given points; repeated points make empty pieces (a token that completes no character)."""
    points = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


def _expected(pieces: list[str], stops: list[str]) -> tuple[str, str | None]:
    """Generation ends with the first piece after which the text holds a stop string; the answer is that text cut at
    the stop string that starts first in it (a longer stop string that started earlier but would only complete in a
    later piece never gets the chance)."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [(text.find(s), i, s) for i, s in enumerate(stops) if text.find(s) >= 0]
        if hits:
            pos, _, s = min(hits)
            return text[:pos], s
    return text, None


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=20),
)
@example(text="<<\n<", stops=["\n", "<\n<"], cuts=[3])  # "\n" completes first, inside the piece "<<\n"
def test_no_stop_prefix_leaks(text: str, stops: list[str], cuts: list[int]) -> None:
    pieces = _split(text, cuts)
    expected, expected_stop = _expected(pieces, stops)
    holder: StopHolder[int] = StopHolder(stops)
    shown = ""
    tokens: list[tuple[int, str]] = []
    stop = None
    for i, piece in enumerate(pieces):
        out = holder.push(i, piece)
        assert out.text == "".join(p for _, p in out.items)
        shown += out.text
        tokens += out.items
        # what has been shown is always a prefix of the final answer: nothing of a stop string ever leaks
        assert expected.startswith(shown), (shown, expected)
        if out.stop is not None:
            stop = out.stop
            break
    else:
        out = holder.flush()
        shown += out.text
        tokens += out.items
    assert shown == expected
    assert "".join(p for _, p in tokens) == expected
    assert [i for i, _ in tokens] == sorted(i for i, _ in tokens)
    if expected_stop is None:
        assert stop is None
    else:
        assert stop is not None and text[len(expected):].startswith(stop)


def test_stop_inside_one_token_with_text_after() -> None:
    holder: StopHolder[str] = StopHolder(["</s>"])
    first = holder.push("t0", "Hi ")
    second = holder.push("t1", "there</s>more")
    assert first.text == "Hi "
    assert second.text == "there" and second.stop == "</s>"
    assert second.items == [("t1", "there")]


def test_stop_spanning_tokens_is_held_then_dropped() -> None:
    holder: StopHolder[int] = StopHolder(["\nUser:"])
    outs = [holder.push(i, p) for i, p in enumerate(["Sure.", "\n", "Us", "er", ":"])]
    assert [o.text for o in outs[:5]] == ["Sure.", "", "", "", ""]
    assert outs[4].stop == "\nUser:"
    assert "".join(o.text for o in outs[:5]) == "Sure."


def test_false_alarm_is_released() -> None:
    holder: StopHolder[int] = StopHolder(["\nUser:"])
    assert holder.push(0, "a\n").text == ""  # "\n" could start the stop string: the token is held
    out = holder.push(1, "Use it")
    assert out.text == "a\nUse it" and [i for i, _ in out.items] == [0, 1]


def test_flush_releases_a_held_tail() -> None:
    holder: StopHolder[int] = StopHolder(["STOP"])
    assert holder.push(0, "ST").text == ""
    assert holder.flush().text == "ST"


def test_no_stop_strings_releases_at_once() -> None:
    holder: StopHolder[int] = StopHolder([])
    assert holder.push(0, "abc").items == [(0, "abc")]


@pytest.mark.parametrize("bad", ["", None])
def test_empty_stop_string_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopHolder([bad])  # type: ignore[list-item]
