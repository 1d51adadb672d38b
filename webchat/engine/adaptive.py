"""Adaptive speculation (`speculative: "auto"`): per sequence and per step, draft only what its verify rows pay for.

Each step every decoding `auto` sequence makes an offer: its best draft from a suffix match over its own prompt and
output, over the recent outputs of the engine's other sequences (webchat.engine.suffix), or from the draft model
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
(webchat.engine.verify_cost). Nothing is granted unless that beats the step without drafts by MARGIN. SmartSpec (Liu et
al., 2024) plans vLLM's speculation lengths by the same measure ("goodput").

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

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import groupby
from typing import Any, Protocol

from webchat.engine.suffix import Index, Path, new_index
from webchat.engine.verify_cost import IDLE_GAP_S, Cycles, VerifyCost

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


class SeqDrafter:
    """One auto sequence's drafting: its own suffix index (prompt and output), its share of the engine-wide one,
    its rates, and the proposals of its last offer, checked against what it emitted next."""

    def __init__(self, spec: AutoSpec, prompt_len: int, model: ModelDrafts | None = None) -> None:
        self.spec, self.prompt_len, self.model = spec, prompt_len, model
        self.own: Index = new_index(0, spec.native_index)
        self.out: list[int] = []  # the output so far, as the engine-wide index holds it
        self.doc = spec.shared.new_doc()
        self.rates: dict[tuple[str, int, bool], Rate] = {}
        self.pending: list[Proposal] = []
        self.probe_every, self.since_probe = PROBE_MIN, 0
        self.rest = 0  # steps this sequence sits out (no offer: its last could not pay at its batch's size)
        self.idle = 0  # its offers that could not pay since it was last granted drafts
        self.prompt_last: dict[int, int] | None = None  # token -> its last position in the prompt (made when needed)
        self.copied: tuple[int, int] | None = None  # where a copy of its own context diverged: (source, context) at

    def rate(self, source: str, b: int, brk: bool = False) -> float:
        engine = self.spec.rate(source, b, brk)
        r = self.rates.get((source, b, brk))
        return engine if r is None else r.estimate(engine, SEQ_PRIOR_WEIGHT)

    def offer(self, context: list[int], room: int, sampled: bool = False, floor: float = 0.0,
              rest: int = 0) -> Proposal | None:
        """The best draft after context (prompt + output, the last token pending), at most `room` tokens; the
        proposals of the last offer are checked first. sampled: verify rows are sampled one by one (costlier).
        floor, rest: where the best draft's first token is less likely than the floor (AutoSpec.floor: what a lone
        token needs to pay at this step; the tokens after it are no likelier), the next `rest` offers are skipped
        (None), twice as many after each such offer since it was last granted drafts (up to REST_MAX; an offer that
        passes the floor but is not granted leaves the count as it is): in a large batch of streams with
        nothing to copy, what the offers cost each step (Python's, 60-90 us each) is then shared among several
        steps; a stream that copies passes the floor nearly every step and never sits out long."""
        if self.rest > 0:
            self.rest -= 1
            return None
        self._sync(context)
        self._check(context)
        room = min(room, MAX_AUTO_DRAFT)
        if room < 1:
            return None
        rates: dict[tuple[str, int, bool], float] = {}  # this offer's rates (no check comes between its paths)
        found = [self._suffix(src, path, context, rates)
                 for src, index, skip in (("context", self.own, None), ("shared", self.spec.shared, self.doc))
                 for path in index.paths(context, room, exclude=skip)]
        if not any(p.source == "context" for p in found):
            path = self._resume(context, room) or self._unigram(context, room)
            if path is not None:
                found.append(self._suffix("context", path, context, rates))
        self.pending = [p for p in found if p.tokens]
        best = max((p for p in self.pending if p.q), key=lambda p: p.value, default=None)
        model = self._model_offer(room, len(context))
        if model is not None and (best is None or model.q[0] > best.q[0]):
            best = model
        if best is not None and sampled:
            best.extra_ms += self.spec.sampled_row_ms
        if rest and (best is None or (best.q[0] < floor and not best.probe)):
            self.rest = min(REST_MAX, rest << min(self.idle, 5))
            self.idle += 1
        return best

    def _resume(self, context: list[int], room: int) -> Path | None:
        """A copy of the context that diverged a few tokens ago (a word fixed, a name changed) and may go on: the
        last token found just after where the copy stopped, and what follows it there (no bigram matches yet)."""
        if self.copied is None:
            return None
        source, at = self.copied
        if not 0 < len(context) - at <= RESUME_WITHIN:
            return None
        last = context[-1]
        j = next((j for j in range(source, min(source + RESUME_WITHIN, at)) if context[j] == last), None)
        return None if j is None else after(context, j, at, room)

    def _unigram(self, context: list[int], room: int) -> Path | None:
        """No bigram of the context's end is in it (a reply's first tokens, before its copy of the prompt's text has
        two): the prompt's last occurrence of the last token, and what follows it there."""
        if self.prompt_last is None:
            self.prompt_last = {t: j for j, t in enumerate(context[: self.prompt_len - 1])}
        j = self.prompt_last.get(context[-1])
        return None if j is None else after(context, j, self.prompt_len - 1, room)

    def _suffix(self, source: str, path: Path, context: list[int],
                rates: dict[tuple[str, int, bool], float]) -> Proposal:
        """path's tokens and their estimates; rates: the offer's rates looked up so far (filled as needed)."""
        breaks, match = self.spec.breaks, path.match
        raw, chance, prev = [], 1.0, context[-1]
        for i, (token, share) in enumerate(zip(path.tokens, path.shares, strict=True)):
            # token i, its predecessors accepted, continues a match of match + i (after a break: prev ends one)
            key = (source, bucket(match + i), prev in breaks)
            r = rates.get(key)
            if r is None:
                r = rates[key] = self.rate(*key)
            chance *= r
            raw.append(chance * share)
            prev = token
        return Proposal(source, match, self.spec.realistic(source, raw), path.tokens, raw, len(context),
                        pos=path.pos)

    def _model_offer(self, room: int, at: int) -> Proposal | None:
        if self.model is None:
            return None
        self.since_probe += 1
        r = self.rate("model", 0)
        raw = [r ** (i + 1) for i in range(room)]
        q = self.spec.realistic("model", raw)
        probe = self.since_probe >= self.probe_every
        if not q and not probe:
            return None
        return Proposal("model", 0, q or [MIN_Q], raw=raw, at=at, extra_ms=self.spec.draft_token_ms, probe=probe)

    def realise(self, p: Proposal, n: int, context: list[int]) -> list[int]:
        """The first n tokens of a granted proposal (a draft model drafts them now)."""
        if p.source == "model":
            assert self.model is not None
            p.tokens = self.model.draft(context, n)[:n]
            self.pending.append(p)
            self.since_probe = 0
        p.granted = min(n, len(p.tokens))
        if p.granted:
            self.idle = 0
        counts = self.spec.counts
        counts.drafted[p.source] += p.granted
        counts.granted += p.granted > 0
        counts.probes += p.probe and p.granted > 0
        return p.tokens[: p.granted]

    def draft(self, context: list[int], k: int) -> list[int]:
        """The Drafter protocol (webchat.engine.speculative): the best offer's tokens, no plan."""
        p = self.offer(context, k)
        return [] if p is None else self.realise(p, len(p.q), context)

    def finish(self, context: list[int]) -> None:
        """The sequence ended: its last proposals checked, its whole output in the engine-wide index."""
        self._sync(context)
        self._check(context)

    def _sync(self, context: list[int]) -> None:
        self.own.add(0, context)  # the context list itself: the engine only appends to it
        start = self.prompt_len + len(self.out)
        if len(context) > start:
            self.out += context[start:]
            self.spec.shared.add(self.doc, self.out)

    def _key(self, p: Proposal, context: list[int], j: int) -> tuple[int, bool]:
        """The rate key a checked token j of p counts under: its match length's bucket and whether it follows a break
        (the draft model's: one rate)."""
        if p.source == "model":
            return 0, False
        return bucket(p.match + j), context[p.at + j - 1] in self.spec.breaks

    def _check(self, context: list[int]) -> None:
        """Each pending proposal against the tokens emitted since: the tokens that came as proposed are hits, the
        first that did not a miss (tokens past what was emitted tell nothing)."""
        left = []
        for p in self.pending:
            tokens, at = p.tokens, p.at
            came = context[at:]
            if not came:
                left.append(p)
                continue
            seen = min(len(tokens), len(came))
            hits = 0
            while hits < seen and tokens[hits] == came[hits]:
                hits += 1
            misses = int(hits < seen)
            if p.source == "context" and misses:
                self.copied = (p.pos + hits, at + hits)
            # token j was a hit or (the last) a miss at match length match + j, after a break (context[at + j - 1]
            # ends one) or not: a run of tokens with the same key counted at a time
            for key, group in groupby(range(hits + misses), partial(self._key, p, context)):
                js = list(group)
                h = sum(j < hits for j in js)
                self.rates.setdefault((p.source, *key), Rate()).add(h, len(js) - h, SEQ_DECAY)
                self.spec.observe(p.source, key[0], h, len(js) - h, key[1])
            told = min(seen, len(p.raw), max(p.granted, 1))  # the tokens this check speaks for
            self.spec.checked(p.source, sum(p.raw[:told]), min(hits, told))
            counts = self.spec.counts
            if p.granted:
                counts.accepted[p.source] += min(hits, p.granted)
            else:
                counts.checked[p.source] += 1
                counts.matched[p.source] += hits > 0
            if p.source == "model" and p.granted:  # the next probe: soon after a hit, later after each miss
                self.probe_every = PROBE_MIN if hits else min(PROBE_MAX, 2 * self.probe_every)
        self.pending = left
