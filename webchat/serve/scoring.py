"""Scoring a text on the websocket (`score`, docs/protocol.md): a message in its chat, or a pasted text alone, read
by the model in one prefill (GenerationRequest.prompt_logprobs, nothing generated); the reply carries the tokens of
that text only.

    score {messages | text} → prompt ids (the chat template without a generation prompt | the text; prepared on the
    request path, webchat.serve.requests) → the engine's PromptTokens (every prompt token scored) → the scored text's
    tokens, found in the prompt's pieces → `scored`
A message's tokens are found by its text: its last occurrence in the prompt's pieces that starts and ends on token
boundaries (a template's markers are whole tokens, so a word inside one never matches), else its last occurrence,
with the tokens at its ends cut to it. The same search serves a remote engine, whose prompt text is the upstream's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from webchat.engine import events as ev
from webchat.serve import protocol as p
from webchat.serve.backend import Scoring

if TYPE_CHECKING:
    pass

MAX_LOSSY = 20_000  # characters of a text searched for with U+FFFD allowed for its non-ASCII characters
MAX_TRIES = 64  # occurrences of the text looked at for one on token boundaries (a text made of one repeated word)
UNAVAILABLE = "scoring needs an engine with prompt logprobs"


def locate(pieces: list[str], target: str) -> tuple[int, int] | None:
    """(start, end) character span of `target` (or of it stripped, as a template may strip a message) in the pieces'
    text: the last occurrence on token boundaries, else the last occurrence; None where it is not there."""
    text = "".join(pieces)
    bounds, at = {0}, 0
    for piece in pieces:
        at += len(piece)
        bounds.add(at)
    cands = [c for c in dict.fromkeys((target, target.strip(), target.lstrip(), target.rstrip())) if c]
    for cand in cands:
        pos = text.rfind(cand)
        for _ in range(MAX_TRIES):
            if pos < 0 or (pos in bounds and pos + len(cand) in bounds):
                break
            pos = text.rfind(cand, 0, pos + len(cand) - 1)
        if pos >= 0:
            return pos, pos + len(cand)
    for cand in cands:  # on no boundary: a message whose first or last token merged with the template's text
        pos = text.rfind(cand)
        if pos >= 0:
            return pos, pos + len(cand)
    return _lossy(text, target) if "\ufffd" in text and len(target) <= MAX_LOSSY else None


def _lossy(text: str, target: str) -> tuple[int, int] | None:
    """The last place `target` may be where tokens were decoded one by one (a remote engine's decoded_token): a
    character split over several tokens is U+FFFD in each of them, so any non-ASCII character may be 1-4 of those."""
    pattern = "".join(re.escape(c) if c.isascii() else f"(?:{re.escape(c)}|\ufffd{{1,4}})" for c in target.strip())
    spans = [m.span() for m in re.finditer(pattern, text)]
    return spans[-1] if spans else None


def target_tokens(tokens: list[ev.TokenInfo], target: str) -> list[ev.TokenInfo] | None:
    """The tokens that carry `target` (cut at its ends, so their pieces join to it), or None where it is not found."""
    span = locate([t.piece for t in tokens], target)
    if span is None:
        return None
    start, end = span
    out, at = [], 0
    for t in tokens:
        lo, hi = at, at + len(t.piece)
        at = hi
        if hi <= start or lo >= end or (lo == hi and not start <= lo < end):
            continue
        piece = t.piece[max(0, start - lo) : len(t.piece) - max(0, hi - end)]
        out.append(t if piece == t.piece else dataclasses.replace(t, piece=piece))
    return out


class ScoreReply:
    """One `score` request's messages from the backend's events: `scored` once the prompt is read (at its Finished,
    with the stats), `done` cancelled if it was stopped first, errors as they come."""

    def __init__(self, request_id: str, model: str, scoring: Scoring) -> None:
        self.request_id, self.model, self.scoring = request_id, model, scoring
        self.tokens: list[ev.TokenInfo] | None = None

    def messages(self, event: ev.Event) -> list[p.ServerMessage]:
        rid = self.request_id
        if isinstance(event, ev.PromptTokens):
            self.tokens = event.tokens
            return []
        if isinstance(event, ev.Tokens):
            return []  # a remote engine may generate a token it was asked for; it is not part of the score
        if isinstance(event, ev.Finished) and event.reason != "cancelled":
            if self.tokens is None:
                return [p.Error(id=rid, code="internal", message="the engine ended without the prompt's scores")]
            found = target_tokens(self.tokens, self.scoring.target)
            if found is None and self.scoring.text:  # a tokenizer that normalises the text: the prompt is the text
                found = self.tokens
            if found is None:
                return [p.Error(id=rid, code="internal", message="the chat template changed the scored message: its "
                                "text is not in the prompt the model read")]
            return [p.Scored(id=rid, model=self.model, tokens=[p.token_out(t) for t in found],
                             stats=p.stats_out(event.stats))]
        return p.event_messages(rid, event, False)
