"""The auto mode's per-sequence side (`speculative: "auto"`, webchat.engine.spec.planner): each step a decoding
sequence offers its best draft (a suffix match over its own context or the engine's other outputs, or the draft
model), checks what it proposed against what it emitted (the shadow check), and keeps its recent rates."""

from __future__ import annotations

from functools import partial
from itertools import groupby

from webchat.engine.spec.planner import AutoSpec
from webchat.engine.spec.rates import (
    MAX_AUTO_DRAFT,
    MIN_Q,
    PROBE_MAX,
    PROBE_MIN,
    REST_MAX,
    RESUME_WITHIN,
    SEQ_DECAY,
    SEQ_PRIOR_WEIGHT,
    ModelDrafts,
    Proposal,
    Rate,
    after,
    bucket,
)
from webchat.engine.spec.suffix import Index, Path, new_index


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
