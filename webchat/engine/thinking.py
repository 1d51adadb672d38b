"""A sequence's thinking in the engine: its reply split into thinking and answer as tokens are released
(webchat.text.thinking_split), the request's budget of thinking tokens, and the closing forced once it is spent.

    state = ThinkingState(request.thinking)      # a request that thinks; None otherwise
    state.release(out, items) / state.flush(out) # released tokens labelled with their part
    state.spend(decoder_pending)                 # the budget reached: the end marker's tokens forced next
    state.forced -> [ids]; state.took(token)     # what the engine must emit next, one token at a time

The engine asks this object; nothing else of a sequence knows how thinking is marked, counted or closed.
"""

from __future__ import annotations

from collections.abc import Callable

from webchat.engine.events import TokenInfo
from webchat.text.thinking_split import Part, PartSplitter, Thinking

Labelled = Callable[[list[tuple[TokenInfo, str, Part]]], None]


class ThinkingState:
    """One sequence's split, budget and forced closing."""

    def __init__(self, thinking: Thinking) -> None:
        self.thinking = thinking
        self.splitter: PartSplitter[TokenInfo] = PartSplitter(thinking.markers, thinking.inside)
        self.forced: list[int] = []  # the closing tokens still to emit (a spent budget)
        self.spent = False

    @property
    def in_thinking(self) -> bool:
        """Inside thinking, or at a reply's start that may still open it (a grammar is off here: it shapes the
        answer)."""
        return self.splitter.in_thinking

    @property
    def may_force(self) -> bool:
        """Whether a budget may still force the closing (each row's mask then follows the tokens before it)."""
        return bool(self.forced) or (self.thinking.budget is not None and not self.spent)

    def release(self, items: list[tuple[TokenInfo, str]], labelled: Labelled) -> None:
        """Tokens the stop holder let go: through the split, their raw text kept, then to `labelled`."""
        for info, piece in items:
            info.raw = piece
            labelled(self.splitter.push(info, piece))

    def flush(self, labelled: Labelled) -> None:
        """The reply ended: held text keeps the part it is in (a reply cut inside thinking stays thinking)."""
        labelled(self.splitter.flush())

    def spend(self, decoder_pending: bool) -> None:
        """Thinking that reached its budget is closed: its closing tokens are forced next (never inside a character
        split over byte tokens: `decoder_pending`)."""
        budget = self.thinking.budget
        if (budget is not None and not self.spent and self.splitter.part == "thinking"
                and self.splitter.thinking_tokens >= budget and not decoder_pending):
            self.forced, self.spent = list(self.thinking.close), True

    def took(self, token: int) -> None:
        """The engine emitted the next forced token (the mask allowed it alone)."""
        if self.forced:
            self.forced.pop(0)
