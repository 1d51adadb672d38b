"""The auto mode's shared terms (webchat.engine.spec.planner, offers): draft sources, match-length buckets and their
priors, the decayed rates, and a sequence's Proposal."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

from webchat.engine.spec.suffix import Path

SOURCES = ("context", "shared", "model")  # own prompt and output; other sequences' outputs; the draft model
BUCKETS = (2, 4, 8, 16)  # match lengths 1 (a copy looked for again), 2-3, 4-7, 8-15, 16+: longer continues more often
PRIORS = {"context": (0.15, 0.25, 0.4, 0.6, 0.8), "shared": (0.1, 0.15, 0.3, 0.5, 0.7), "model": (0.4,)}  # at start
BREAK_PRIOR = 0.5  # a token after a break (a sentence's or a line's end): its prior is this share of the others'
ENGINE_PRIOR_WEIGHT = 8.0  # events the start values count as
ENGINE_DECAY = 0.995  # engine-wide rate: weight of the past per event
SEQ_PRIOR_WEIGHT = 2.0  # a sequence's rate is shrunk towards the engine-wide one by this many events
SEQ_DECAY = 0.85  # a sequence's rate: weight of the past per event (about the last 7 events)
RESUME_WITHIN = 6  # a diverged copy is looked for again this many tokens on, from where it stopped
MAX_AUTO_DRAFT = 16  # draft tokens a sequence may be granted in one step
MAX_STEP_ROWS = 64  # rows the planner fills a step up to (the CPU step's one-call limit, kernels/cpu/step.py)
MIN_Q = 0.05  # draft tokens less likely than this are not offered
REALISM_DECAY = 0.98  # the engine-wide realism of a source's estimates: weight of the past per checked proposal
REALISM_WEIGHT = 2.0  # accepted tokens the start value (1: estimates taken as they are) counts as
REALISM_RANGE = (0.25, 1.25)
MARGIN = 0.03  # drafts must promise this many more tokens per ms than the step without them
SHARED_TOKENS = 1 << 16  # output tokens the engine-wide index keeps (the oldest outputs dropped first)
PROBE_MIN, PROBE_MAX = 8, 128
REST_MAX = 32  # steps a stream whose offers keep failing to pay sits out at most (rest, 2 rest, 4 rest, ... steps)
PAYOFF_DECAY = 0.9  # a batch size's payoff: weight of the past per step with grants (about the last 10)
PAYOFF_PRIOR = 3.0  # steps the start value (plans come true: log 1 = 0) counts as
PAYOFF_FORGET = 0.995  # per step a batch size plans and grants nothing: its evidence fades (halved in ~140 steps)
PAYOFF_RANGE = (0.25, 1.25)


def batch_bucket(rows: int) -> int:
    """The batch sizes whose plans share a payoff: 1, 2, 3, 4, 5-7, 8-15, 16+ decode rows."""
    return rows if rows <= 4 else 5 if rows < 8 else 8 if rows < 16 else 16


class ModelDrafts(Protocol):
    """A draft model's drafter (webchat.engine.speculative.ModelDrafter)."""

    def draft(self, context: list[int], k: int) -> list[int]: ...


class Rate:
    """Decayed counts of accepted / checked draft tokens."""

    __slots__ = ("events", "hits")

    def __init__(self) -> None:
        self.hits = self.events = 0.0

    def add(self, hits: int, misses: int, decay: float) -> None:
        for _ in range(hits):
            self.hits, self.events = self.hits * decay + 1, self.events * decay + 1
        for _ in range(misses):
            self.hits, self.events = self.hits * decay, self.events * decay + 1

    def estimate(self, prior: float, weight: float) -> float:
        return (self.hits + weight * prior) / (self.events + weight)


_BUCKET_OF = [bisect.bisect_right(BUCKETS, m) for m in range(BUCKETS[-1] + 1)]  # bucket(m) for the short matches


def bucket(match: int) -> int:
    return _BUCKET_OF[match] if match < len(_BUCKET_OF) else len(BUCKETS)


def ends_break(text: str) -> bool:
    """Whether a token's text ends a sentence or a line: a newline in it, or its end (closing quotes and brackets and
    spaces aside) a full stop, a question or an exclamation mark."""
    return "\n" in text or text.rstrip(" \"')]»”’").endswith((".", "!", "?", "。", "！", "？"))


def after(context: list[int], j: int, end: int, room: int) -> Path | None:
    """A match of length 1 at context[j]: the tokens after it, before `end`, at most `room`."""
    tokens = context[j + 1 : min(j + 1 + room, end)]
    return Path(1, tokens, [1.0] * len(tokens), j + 1) if tokens else None


@dataclass
class Proposal:
    """A draft a sequence offers: tokens (a draft model's come when granted) and q (see the module doc)."""

    source: str
    match: int  # context tokens the suffix source matched (0: the draft model)
    q: list[float]
    tokens: list[int] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)  # q before the source's realism, for every token
    at: int = 0  # the context's length when proposed
    granted: int = 0
    extra_ms: float = 0.0  # per granted token, beyond its verify row
    probe: bool = False  # a draft model's probe: one token granted whatever the plan
    pos: int = -1  # a suffix source: where tokens begin in the doc they were copied from

    @property
    def value(self) -> float:
        return sum(self.q)


