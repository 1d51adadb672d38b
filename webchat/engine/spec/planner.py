"""Adaptive speculation (`speculative: "auto"`): per sequence and per step, draft only what its verify rows pay for.

Each step every decoding `auto` sequence makes an offer: its best draft from a suffix match over its own prompt and
output, over the recent outputs of the engine's other sequences (webchat.engine.spec.suffix), or from the draft model
(`--draft`). Where no bigram of the context's end is in its context, the last token alone is looked for (a match of
length 1, with its own rates): just after where a copy of the context diverged a few tokens ago (a word fixed, a name
changed), else at its last occurrence in the prompt (a reply's first token, as it starts copying the prompt's text).
Draft token i carries q_i, the estimated chance that it and every token before it are accepted:

    q_i = k * r_0 * ... * r_i * share_i
                               r_j: the sequence's recent acceptance for that source at the match length token j
                               continues (a suffix match of m tokens: m + j, as its predecessors were accepted; a copy
                               that has just resumed fails often at first and seldom once it has gone on) and whether
                               the token before it ends a sentence or a line (a break: where a reply chooses what to
                               say next, and a copy most often stops; within a sentence a long match goes on at
                               0.95-0.99, after a break at 0.5-0.8, docs/perf-history.md), shrunk
                               towards the engine-wide rate while the sequence has little history; share_i: the share
                               of the matched occurrences that agree up to token i (suffix sources; 1 for the draft
                               model, whose r_j is one rate); k: the source's realism, tokens accepted over tokens
                               expected on the proposals checked lately, engine-wide (within [1/4, 5/4]), so
                               estimates that run high are pulled down

The planner grants the step's draft tokens greedily by q and keeps the prefix of grants with the most expected
tokens per ms of the step: (rows without drafts + sum q) / (forward(rows + granted) + time between forwards + a draft
model's forwards + the sampling of rows verified one by one), the forward from the measured curve
(webchat.engine.spec.verify_cost). Nothing is granted unless that beats the step without drafts by MARGIN. SmartSpec
(Liu et al., 2024) plans vLLM's speculation lengths by the same measure ("goodput").

The plans are checked too. After each step with grants, the tokens it emitted over its whole cycle (from its forward's
start to the next forward's: the sampling and the delivery of its tokens included, as a served stream pays them) against
what the plan expected: the log of that ratio, decayed over the last steps, per batch size (`payoff`). Its exponent
scales the expected rates of later plans at that batch size, so where drafting has lost (a cost curve measured alone
that a busy batch outruns, estimates that run high together) the planner asks for that much more before it drafts, and
where it paid more than planned, a little less. A batch size that stops drafting forgets its evidence step by step
(PAYOFF_FORGET) and tries again.

Every proposal is checked against what the sequence emitted next, drafted or not: a shadow check, free for the suffix
sources; each token checked counts at the match length it continued. A source that keeps failing loses its grants as its
rate falls, and wins them back when its proposals match again. A draft model's proposal costs a forward a token, so once
its rate has fallen it is probed with one token at growing intervals (PROBE_MIN steps, doubled after each miss, up to
PROBE_MAX).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from webchat.engine.spec.rates import (
    BREAK_PRIOR,
    ENGINE_DECAY,
    ENGINE_PRIOR_WEIGHT,
    MARGIN,
    MIN_Q,
    PAYOFF_DECAY,
    PAYOFF_FORGET,
    PAYOFF_PRIOR,
    PAYOFF_RANGE,
    PRIORS,
    REALISM_DECAY,
    REALISM_RANGE,
    REALISM_WEIGHT,
    SHARED_TOKENS,
    SOURCES,
    Proposal,
    Rate,
    batch_bucket,
    ends_break,
)
from webchat.engine.spec.suffix import Index, new_index
from webchat.engine.spec.verify_cost import IDLE_GAP_S, Cycles, VerifyCost


@dataclass
class Counts:
    """The planner's decisions, for /api/info and the served benchmark."""

    steps: int = 0  # steps with a decoding auto sequence
    offers: int = 0  # sequence-steps planned
    proposed: int = 0  # of them, with a draft to offer
    granted: int = 0  # of them, granted draft rows
    probes: int = 0
    drafted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    checked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))  # shadow checks
    matched: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))  # ... whose first token came


class AutoSpec:
    """The engine-wide side: the cost curve, the time between forwards, the shared output index, the engine-wide
    rates, the planner and its counts."""

    def __init__(self, shared_tokens: int = SHARED_TOKENS, native_index: Callable[..., Any] | None = None) -> None:
        self.cost: VerifyCost | None = None  # measured by Engine.calibrate (warm-up, or the first auto step)
        self.cycles = Cycles()
        self.native_index = native_index  # the C++ suffix index where the model's backend has one (suffix.new_index)
        self.shared: Index = new_index(shared_tokens, native_index)
        self.rates: dict[tuple[str, int, bool], Rate] = {}
        self.breaks: frozenset[int] = frozenset()  # tokens that end a sentence or a line (set_breaks)
        self.realism: dict[str, tuple[float, float]] = {}  # source -> decayed (tokens expected, tokens accepted)
        self.sampled_row_ms = 0.0  # sampling one verify row of a sampled sequence (rows verified one by one)
        self.draft_token_ms = 0.0  # one draft model forward
        self.counts = Counts()
        self.payoff: dict[int, tuple[float, float]] = {}  # batch bucket -> decayed (sum of log(got / planned), steps)
        self._planned: tuple[int, float, float, float] | None = None  # the last plan: bucket, tokens, ms, extra ms
        self._ran: tuple[int, float, float, float, int, float, float] | None = None  # ... and its step: emitted, times

    def set_breaks(self, texts: list[str]) -> None:
        """The vocabulary's texts (by id): the tokens that end a sentence (., !, ? with any closing quote or bracket)
        or a line, after which a draft's token follows a break."""
        self.breaks = frozenset(t for t, text in enumerate(texts) if ends_break(text))

    def payoff_factor(self, key: int) -> float:
        """How the plans at this batch bucket came true lately: exp(mean log(got / planned)), within PAYOFF_RANGE."""
        total, steps = self.payoff.get(key, (0.0, 0.0))
        return min(PAYOFF_RANGE[1], max(PAYOFF_RANGE[0], math.exp(total / (steps + PAYOFF_PRIOR))))

    @property
    def planned(self) -> bool:
        """Whether the last plan granted drafts that a step is about to run (its outcome is wanted)."""
        return self._planned is not None

    def discard_plan(self) -> None:
        """The last plan's grants were not run (a new step begins, or its pages were short)."""
        self._planned = None

    def outcome(self, emitted: int, began: float, ended: float) -> None:
        """The step the last plan granted drafts to has run: its forward began at `began` and the step emitted
        `emitted` tokens; the step's cost is known when the next forward begins (`next_forward`)."""
        if self._planned is not None:
            self._ran = (*self._planned, emitted, began, ended)
        self._planned = None

    def next_forward(self, now: float, prompt: bool = False) -> None:
        """A forward begins at `now`: the last drafted step's whole cycle (its forward, its sampling, the delivery of
        what it emitted and the planning of this one, as a served stream pays them) against the plan's (its forward
        from the curve and the median time between forwards); an idle gap after it tells nothing. prompt: the forward
        has a prompt's rows, whose admission (a request read, its text tokenized, a finished one answered: a single
        stream's turn between requests) the gap holds too; the step is charged the median time between forwards."""
        if self._ran is None:
            return
        key, tokens, planned_ms, extra, emitted, began, ended = self._ran
        self._ran = None
        if now - ended >= IDLE_GAP_S:
            return
        if prompt:
            now = min(now, ended + self.cycles.overhead_ms / 1000)
        got = emitted / max(1e-6, (now - began) * 1000)
        planned = tokens / max(1e-6, planned_ms + self.cycles.overhead_ms + extra)
        log_ratio = math.log(max(1e-3, got / planned))
        total, steps = self.payoff.get(key, (0.0, 0.0))
        self.payoff[key] = (total * PAYOFF_DECAY + log_ratio, steps * PAYOFF_DECAY + 1)

    def rate(self, source: str, b: int, brk: bool = False) -> float:
        r = self.rates.get((source, b, brk))
        prior = PRIORS[source][b] * (BREAK_PRIOR if brk else 1.0)
        return prior if r is None else r.estimate(prior, ENGINE_PRIOR_WEIGHT)

    def observe(self, source: str, b: int, hits: int, misses: int, brk: bool = False) -> None:
        self.rates.setdefault((source, b, brk), Rate()).add(hits, misses, ENGINE_DECAY)

    def realistic(self, source: str, raw: list[float]) -> list[float]:
        """raw estimates scaled by the source's realism, capped at 0.99, cut where they fall under MIN_Q."""
        expected, accepted = self.realism.get(source, (0.0, 0.0))
        k = min(REALISM_RANGE[1], max(REALISM_RANGE[0], (accepted + REALISM_WEIGHT) / (expected + REALISM_WEIGHT)))
        q = []
        for x in raw:
            if x * k < MIN_Q:
                break
            q.append(min(0.99, x * k))
        return q

    def checked(self, source: str, expected: float, accepted: int) -> None:
        """A proposal checked: `expected` tokens of it were expected to come (its raw estimates), `accepted` came."""
        e, a = self.realism.get(source, (0.0, 0.0))
        self.realism[source] = (e * REALISM_DECAY + expected, a * REALISM_DECAY + accepted)

    def timed(self, began: float, ended: float, rows: int) -> None:
        """A forward ran from began to ended (perf_counter seconds); rows: its decode/verify rows, 0 when it had prompt
        rows too (the curve's scale follows the former only)."""
        self.next_forward(began, prompt=not rows)
        self.cycles.forward_began(began)
        self.cycles.forward_ended(ended)
        if rows and self.cost is not None:
            self.cost.observe(rows, (ended - began) * 1000)

    def remember(self, output: list[int]) -> None:
        """A finished sequence's output, for the others' drafts (auto sequences add theirs as they go)."""
        if len(output) >= 2:
            self.shared.add(self.shared.new_doc(), list(output))

    def plan(self, offers: list[Proposal | None], base_rows: int, base_tokens: int, room: int) -> list[int]:
        """Draft tokens granted to each offer: the prefix of all offered tokens, most likely first, with the most
        expected tokens per ms, if it beats the step without drafts by MARGIN; probes get one token regardless."""
        assert self.cost is not None, "plan() needs a measured cost curve"
        self.counts.steps += 1
        self.counts.offers += len(offers)
        self.counts.proposed += sum(p is not None for p in offers)
        ranked = sorted(((q, j, i) for i, p in enumerate(offers) if p is not None for j, q in enumerate(p.q)),
                        key=lambda c: (-c[0], c[1]))[: max(0, room)]
        overhead, fwd, added = self.cycles.overhead_ms, self.cost.forward_ms, self.cost.added_ms
        key = batch_bucket(base_rows)
        best_n, tokens, extra = 0, float(base_tokens), 0.0
        self._planned = None
        if ranked:  # (nothing offered, the step as it is: most steps of streams with nothing to copy)
            payoff, base_ms = self.payoff_factor(key), fwd(base_rows)
            best = base_tokens / (base_ms + overhead) * (1 + MARGIN) if base_rows else 0.0
        for n, (q, _, i) in enumerate(ranked, 1):
            p = offers[i]
            assert p is not None
            tokens += q
            extra += p.extra_ms
            ms = base_ms + added(base_rows, base_rows + n)
            rate = payoff * tokens / (ms + overhead + extra)
            if rate > best:
                best, best_n = rate, n
                self._planned = (key, tokens, ms, extra)
        if not best_n and key in self.payoff:  # nothing granted: this bucket's evidence fades
            total, steps = self.payoff[key]
            self.payoff[key] = (total * PAYOFF_FORGET, steps * PAYOFF_FORGET)
        grants = [0] * len(offers)
        for _, _, i in ranked[:best_n]:
            grants[i] += 1
        for i, p in enumerate(offers):
            if p is not None and p.probe and not grants[i] and room > sum(grants):
                grants[i] = 1
        return grants

    def floor(self, base_rows: int, base_tokens: int) -> float:
        """The chance a lone draft token needs to pay for its verify row at a step of base_rows rows without drafts
        that emits base_tokens (the marginal row's share of the step's time, in tokens)."""
        assert self.cost is not None
        cost = self.cost
        return (base_tokens * cost.added_ms(base_rows, base_rows + 1)
                / max(1e-6, cost.forward_ms(base_rows) + self.cycles.overhead_ms))

    def info(self) -> dict[str, object]:
        """The curve, the time between forwards, the decisions and the engine-wide rates (/api/info)."""
        c = self.counts
        return {"cost": None if self.cost is None else self.cost.wire(),
                "between_steps_ms": round(self.cycles.overhead_ms, 3),
                "sampled_row_ms": round(self.sampled_row_ms, 3), "draft_token_ms": round(self.draft_token_ms, 3),
                "steps": c.steps, "offers": c.offers, "proposed": c.proposed, "granted": c.granted,
                "probes": c.probes, "drafted": dict(c.drafted), "accepted": dict(c.accepted),
                "shadow_checked": dict(c.checked), "shadow_matched": dict(c.matched),
                "rates": {f"{s}/{b}" + "/break" * brk: round(self.rate(s, b, brk), 3)
                          for s, b, brk in sorted(self.rates)},
                "realism": {s: round((a + REALISM_WEIGHT) / (e + REALISM_WEIGHT), 3)
                            for s, (e, a) in sorted(self.realism.items())},
                "payoff": {str(k): round(self.payoff_factor(k), 3) for k in sorted(self.payoff)}}


