"""A reply split into thinking and answer as it streams, on the text of the model's markers (`<think>`, `</think>`).

    splitter = PartSplitter(Markers("<think>", "</think>"), inside=False)
    for token, piece in stream: for item, piece, part in splitter.push(token, piece): ...
    splitter.flush()          # the reply ended: what is held keeps the part it is in (cut inside thinking: thinking)

A reply is thinking when it opens with the start marker (after optional whitespace), or from its first token when
the prompt already opened it (`inside`: templates that end the generation prompt with `<think>`); thinking ends at
the end marker. Markers are matched on text, so one split over several tokens (or chunks) is found: text that may
be the start of a marker is held back, whole tokens at a time, until it is known (as stop strings are held,
webchat.text.stops). Marker characters, and whitespace between the end marker and the answer, leave the text: a
token's piece keeps only its own part's characters. A token must have one part, so one whose text crosses a marker
(rare: real reasoning models have each marker as one token) takes the part of what follows the marker when anything
does, else the part before it. A start marker later in the answer is answer text, as in llama.cpp and vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

T = TypeVar("T")
Part = Literal["thinking", "answer"]
# opening / after: just past the start / end marker, dropping whitespace before the thinking / the answer
State = Literal["start", "opening", "thinking", "after", "answer"]


@dataclass(frozen=True)
class Markers:
    start: str = "<think>"
    end: str = "</think>"

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError(f"reasoning markers must be non-empty, got {self.start!r} and {self.end!r}")


@dataclass(frozen=True)
class Thinking:
    """How a request's reply is split into thinking and answer, and how long its thinking may run.

    inside: the prompt already opened thinking. budget: thinking tokens after which `close` is forced (llama-server's
    --reasoning-budget: the tokens after the start marker, or from the first when `inside`; 0 closes at once), once
    the character in progress is whole; close: the token ids that end thinking (the end marker as the tokenizer
    writes it, with the whitespace the template puts around it)."""

    markers: Markers = Markers()
    inside: bool = False
    budget: int | None = None
    close: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.budget is not None and (self.budget < 0 or not self.close):
            raise ValueError(f"a reasoning budget must be >= 0 and come with the tokens that close thinking, got "
                             f"budget {self.budget} and {len(self.close)} closing tokens")


class PartSplitter(Generic[T]):
    """Labels each (item, piece) with its part; releases items once their part and visible text are known."""

    def __init__(self, markers: Markers, inside: bool = False) -> None:
        self.markers = markers
        self.state: State = "thinking" if inside else "start"
        self._held: list[tuple[T, str]] = []  # tokens whose text may still be (part of) a marker
        self._blank = 0  # held tokens at a reply's start that are whitespace alone (held without re-reading them)
        self.thinking_tokens = 0  # tokens released as thinking after the start marker

    @property
    def part(self) -> Part:
        """The part the next text belongs to, as far as the text so far tells."""
        return "thinking" if self.state in ("opening", "thinking") else "answer"

    @property
    def in_thinking(self) -> bool:
        """Inside thinking, or at the start of a reply that may still open it."""
        return self.state in ("start", "opening", "thinking")

    def push(self, item: T, piece: str) -> list[tuple[T, str, Part]]:
        self._held.append((item, piece))
        if self.state == "start" and self._blank == len(self._held) - 1 and not piece.strip():
            self._blank += 1  # whitespace before the reply's first text: held, in constant time a token
            return []
        text = "".join(p for _, p in self._held)
        if self.state == "start":
            return self._at_start(text)
        if self.state == "thinking":
            return self._in_thinking(text)
        if self.state in ("opening", "after"):
            return self._past_marker(text)
        return self._release("answer")

    def flush(self) -> list[tuple[T, str, Part]]:
        """The reply ended: held text is its part's own (a marker never completed is text)."""
        return self._release(self.part)

    # ------------------------------------------------------------ states
    def _at_start(self, text: str) -> list[tuple[T, str, Part]]:
        start = self.markers.start
        body = text.lstrip()
        if body.startswith(start):  # opened: the marker (and what precedes it) leaves the text
            out = self._cut(text, 0, text.index(start) + len(start), "thinking", "opening")  # whitespace leaves too
            self.thinking_tokens -= len(out)  # a budget counts the tokens after the start marker (llama.cpp's)
            return out + self._past_marker("".join(p for _, p in self._held)) if self._held else out
        if body == "" or start.startswith(body):
            return []  # whitespace, or the start marker so far: hold
        self.state = "answer"
        return self._release("answer")

    def _in_thinking(self, text: str) -> list[tuple[T, str, Part]]:
        end = self.markers.end
        at = text.find(end)
        if at >= 0:
            out = self._cut(text, at, at + len(end), "thinking", "after")
            return out + self._past_marker("".join(p for _, p in self._held)) if self._held else out
        keep = _held_from(text, end)  # a tail that may begin the end marker stays held
        return self._release_upto(keep, "thinking")

    def _past_marker(self, text: str) -> list[tuple[T, str, Part]]:
        """Just past a marker: whitespace before the thinking or the answer leaves the text."""
        part = self.part
        if text.strip() == "":
            return self._release_blank(part)
        self.state = "thinking" if part == "thinking" else "answer"
        if part == "thinking":  # the thinking's own text may hold the end marker already
            lead = len(text) - len(text.lstrip())
            out = self._strip_lead(lead, part)
            return out + self._in_thinking("".join(p for _, p in self._held)) if self._held else out
        return self._strip_lead(len(text) - len(text.lstrip()), part) + self._release(part)

    # ------------------------------------------------------------ releasing held tokens
    def _release(self, part: Part) -> list[tuple[T, str, Part]]:
        out = [(item, piece, part) for item, piece in self._held]
        self._count(out)
        self._held = []
        return out

    def _release_blank(self, part: Part) -> list[tuple[T, str, Part]]:
        out: list[tuple[T, str, Part]] = [(item, "", part) for item, _ in self._held]
        self._held = []
        self._count(out)
        return out

    def _release_upto(self, upto: int, part: Part) -> list[tuple[T, str, Part]]:
        """Release the leading held tokens whose text ends at or before char `upto`."""
        out: list[tuple[T, str, Part]] = []
        end = 0
        while self._held and end + len(self._held[0][1]) <= upto:
            item, piece = self._held.pop(0)
            end += len(piece)
            out.append((item, piece, part))
        self._count(out)
        return out

    def _strip_lead(self, lead: int, part: Part) -> list[tuple[T, str, Part]]:
        """The first `lead` chars of the held text (whitespace) leave it; tokens left with no text are released as
        `part`, the rest stay held with what they keep."""
        out: list[tuple[T, str, Part]] = []
        rest: list[tuple[T, str]] = []
        pos = 0
        for item, piece in self._held:
            keep = piece[max(0, lead - pos):]
            pos += len(piece)
            if keep or rest:
                rest.append((item, keep))
            else:
                out.append((item, "", part))
        self._held = rest
        self._count(out)
        return out

    def _cut(self, text: str, at: int, past: int, before: Part, state: State) -> list[tuple[T, str, Part]]:
        """A marker spans chars [at, past) of the held text: tokens wholly before it are released as `before`; the
        token holding its last char, and any holding only marker chars, lose the marker's chars; what follows the
        marker stays held for the next state. A token crossing the marker takes the next part if it keeps text past
        the marker (decided by the caller's next state), else `before`."""
        out: list[tuple[T, str, Part]] = []
        rest: list[tuple[T, str]] = []
        pos = 0
        for item, piece in self._held:
            lo, hi = pos, pos + len(piece)
            pos = hi
            if hi <= at:
                out.append((item, piece, before))
            elif lo >= past:
                rest.append((item, piece))
            else:
                kept_after = piece[max(0, past - lo):]
                if kept_after:  # crosses into what follows: held with (only) the text past the marker
                    rest.append((item, kept_after))
                else:
                    out.append((item, piece[: max(0, at - lo)], before))
        self._count(out)
        self._held = rest
        self.state = state
        return out

    def _count(self, out: list[tuple[T, str, Part]]) -> None:
        self.thinking_tokens += sum(1 for _, _, part in out if part == "thinking")


def _held_from(text: str, marker: str) -> int:
    """The earliest index whose suffix of `text` is a proper prefix of `marker`; len(text) when none."""
    for i in range(max(0, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[i:]):
            return i
    return len(text)
