"""The auto mode's parts: the suffix index, the verify-cost curve (robust to a noisy machine), the planner's
decisions, and a sequence's drafting that stops when its source fails and resumes when it matches again."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from webchat.engine.engine import Engine
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings
from webchat.engine.spec.offers import SeqDrafter
from webchat.engine.spec.planner import AutoSpec
from webchat.engine.spec.rates import (
    MAX_AUTO_DRAFT,
    PAYOFF_RANGE,
    PROBE_MAX,
    PROBE_MIN,
    RESUME_WITHIN,
    SEQ_DECAY,
    Proposal,
    bucket,
    ends_break,
)
from webchat.engine.spec.suffix import MAX_MATCH, MAX_OCCURRENCES, MIN_SHARE, SPEC_OFFSET, SuffixIndex, follow
from webchat.engine.spec.suffix import Path as SuffixPath
from webchat.engine.spec.verify_cost import Cycles, VerifyCost, lowered, measure
from webchat.kernels.backend import load_model
from webchat.model.batch import Batch
from webchat.model.kv_cache import KVPool, PoolExhausted
from webchat.text.tokenizer import Tokenizer

GREEDY = SamplingSettings(temperature=0.0)


# ---------------------------------------------------------------- the suffix index
def test_a_copied_text_is_proposed_from_the_longest_match() -> None:
    text = list(range(100, 140))
    index = SuffixIndex()
    context = [1, 2, *text, 7, 8, *text[:10]]  # the text again, its first 10 tokens so far
    index.add(0, context)
    paths = index.paths(context, 8)
    assert paths[0].tokens == text[10:18] and paths[0].match >= 10 and paths[0].shares == [1.0] * 8


def test_disagreeing_occurrences_give_the_majority_and_its_share() -> None:
    index = SuffixIndex()
    index.add(1, [5, 6, 7, 1])
    index.add(2, [5, 6, 7, 1])
    index.add(3, [5, 6, 7, 2])
    index.add(4, [5, 6, 9, 3])
    paths = index.paths([4, 5, 6], 4)
    common = paths[-1]  # all four occurrences of (5, 6): three go on with 7, then two of them with 1
    assert common.tokens == [7, 1] and common.shares == pytest.approx([0.75, 0.5])
    assert index.paths([4, 5, 6], 4, exclude=4)[-1].shares[0] == 1.0  # doc 4 not looked at


def test_the_shared_index_keeps_its_newest_docs_and_compacts() -> None:
    index = SuffixIndex(max_tokens=100)
    docs = []
    for i in range(12):
        doc = index.new_doc()
        docs.append(doc)
        index.add(doc, [1000 + i, 1, 2, 3, 4, 5, 6, 7, 8, 9 + i])
    assert index.size <= 100 and docs[0] not in index.docs and docs[-1] in index.docs
    assert all(code >> 32 in index.docs for codes in index.where.values() for code in codes) or index.dead > 0
    assert index.dead <= index.size  # stale occurrences compacted once they outnumber the live ones
    assert index.paths([0, 7, 8], 1)[0].tokens == [9 + 11]  # the newest occurrence first


def test_a_growing_doc_is_indexed_once_per_token() -> None:
    index = SuffixIndex()
    tokens = [1, 2, 3]
    index.add(0, tokens)
    tokens += [1, 2]
    index.add(0, tokens)
    assert index.where[1 << 32 | 2] == [2]  # (1, 2) at 0 continued at 2; the second (1, 2) has no continuation yet
    tokens.append(4)
    index.add(0, tokens)
    assert index.where[1 << 32 | 2] == [2, 5] and index.size == 6
    newest, both = index.paths([9, 1, 2], 3)[-1], index.paths([9, 1, 2], 3)
    assert len(both) == 1 and newest.tokens == [4] and newest.shares == [0.5]  # a tie: the newest occurrence


def test_the_cpp_index_answers_as_the_python_one_call_for_call(kernels: Any) -> None:
    # random docs over small vocabularies (many shared bigrams, ties, matches cut by MAX_MATCH and MAX_OCCURRENCES),
    # docs dropped past max_tokens and compacted, lookups with and without a doc excluded: every Path equal, floats
    # bit for bit, and the same sizes after every call
    mismatched = []
    for seed in range(120):
        rng = random.Random(seed)
        vocab, max_tokens = rng.choice([2, 3, 5, 40]), rng.choice([0, 40, 300])
        ours = SuffixIndex(max_tokens)
        cpp = kernels.SuffixIndex(max_tokens, MAX_OCCURRENCES, MAX_MATCH, MIN_SHARE, SPEC_OFFSET, SuffixPath)
        docs: dict[int, list[int]] = {}
        for step in range(150):
            if rng.random() < 0.15 or not docs:
                doc = ours.new_doc()
                assert cpp.new_doc() == doc
                docs[doc] = [rng.randrange(vocab) for _ in range(rng.randrange(6))]
                ours.add(doc, docs[doc])
                cpp.add(doc, docs[doc])
            elif rng.random() < 0.5:
                doc = rng.choice(list(docs))
                docs[doc] += [rng.randrange(vocab) for _ in range(rng.randrange(1, 80 if vocab < 5 else 4))]
                ours.add(doc, docs[doc])
                cpp.add(doc, docs[doc])
            else:
                source = rng.choice(list(docs.values()))
                context = source[-rng.randrange(1, 90):] + [rng.randrange(vocab) for _ in range(rng.randrange(3))]
                limit, skip = rng.randrange(20), rng.choice([None, *list(docs)[-3:]])
                if ours.paths(context, limit, exclude=skip) != cpp.paths(context, limit, exclude=skip):
                    mismatched.append((seed, step))
            assert (cpp.size, cpp.dead, cpp.docs) == (ours.size, ours.dead, list(ours.docs))
    assert not mismatched
    doc = cpp.new_doc()
    with pytest.raises(RuntimeError, match=f"token -1 at 1 of doc {doc} is not in"):
        cpp.add(doc, [1, -1])


def test_a_cpu_models_engine_plans_on_the_cpp_index(tiny_model_dir: Path, kernels: Any) -> None:
    model, tok = load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)
    engine = Engine(model, tok)
    assert model.suffix_index is kernels.SuffixIndex and isinstance(engine.auto.shared, kernels.SuffixIndex)
    g = Generator(model, tok, engine=engine)
    g.begin_stream(GenerationRequest(prompt_ids=list(range(100, 140)) * 2, settings=GREEDY, max_new_tokens=8,
                                     speculative="auto"))
    seq = g._seq
    assert seq is not None and isinstance(seq.offers, SeqDrafter) and isinstance(seq.offers.own, kernels.SuffixIndex)
    while not g.stream().eos:
        pass
    assert not isinstance(AutoSpec().shared, kernels.SuffixIndex)  # no backend's class: the Python one


def test_follow_takes_the_majority_token_by_token_as_occurrences_end_and_disagree() -> None:
    # the rule, one token at a time: the most common next token of the live occurrences (ties: the newest, first),
    # the share times its part of them, the others dropped, until the share falls under MIN_SHARE or every
    # occurrence has ended
    def one_at_a_time(found: list[tuple[int, list[int], int]], limit: int) -> tuple[list[int], list[float]]:
        live, share, tokens, shares = [(t, p) for _, t, p in found], 1.0, [], []
        for i in range(limit):
            nexts = [t[p + i] if p + i < len(t) else -1 for t, p in live]
            votes = [t for t in nexts if t >= 0]
            if not votes:
                break
            token = max(dict.fromkeys(votes), key=votes.count)
            share *= votes.count(token) / len(live)
            if share < MIN_SHARE:
                break
            tokens.append(token)
            shares.append(share)
            live = [o for o, t in zip(live, nexts, strict=True) if t == token]
        return tokens, shares

    rng = random.Random(7)
    runs = 0
    for _ in range(400):
        base = [rng.randrange(6) for _ in range(12)]
        found = []
        for _ in range(rng.randrange(2, 12)):  # copies of one text, some cut short, some changed at a token or two
            doc = [9, *base[: rng.randrange(4, 13)]]
            for _ in range(rng.randrange(3)):
                doc[rng.randrange(1, len(doc))] = rng.randrange(6)
            found.append((2, doc, 1))
        limit = rng.randrange(1, 14)
        path = follow(found, 2, limit)
        assert (path.tokens, path.shares) == one_at_a_time(found, limit)
        runs += len(path.shares) > 1 and path.shares[1] == path.shares[0]
    assert runs > 50  # the cases held runs of agreement as well as disagreements and ends


# ---------------------------------------------------------------- the cost curve
def test_a_slow_sample_is_lowered_to_what_fewer_rows_cost() -> None:
    # 2 rows at 60: above two 1-row forwards (20) and above 3 rows (30); 3 rows at 30 never more than 4 rows
    assert lowered([0, 10, 60, 30, 28]) == [0, 10, 20, 28, 28]


def test_curve_interpolates_and_extrapolates_monotonically() -> None:
    cost = VerifyCost({1: 10.0, 2: 12.0, 4: 20.0, 8: 30.0})
    assert cost.forward_ms(3) == pytest.approx(16.0) and cost.forward_ms(8) == 30.0
    assert cost.forward_ms(12) == pytest.approx(30.0 + 4 * 20 / 7)  # the mean slope beats the last segment's 2.5
    assert all(cost.forward_ms(t) <= cost.forward_ms(t + 1) for t in range(1, 80))
    assert all(cost.forward_ms(a + b) <= cost.forward_ms(a) + cost.forward_ms(b) + 1e-9
               for a in range(1, 40) for b in range(1, 40))
    with pytest.raises(ValueError, match=r"points at rows >= 1, got \[0\]"):
        VerifyCost({0: 1.0})


def test_the_curve_scales_to_the_forwards_the_engine_runs() -> None:
    cost = VerifyCost({1: 10.0, 8: 38.0})
    for _ in range(9):
        cost.observe(1, 5.0)  # the machine got twice as fast since the warm-up
    cost.observe(3, 1000.0)  # one forward slowed by another process
    assert cost.scale == pytest.approx(0.5) and cost.forward_ms(8) == pytest.approx(19.0)
    cost.observe(0, 1.0)  # no rows: nothing to compare
    cost.observe(99, 1.0)
    assert cost.scale == pytest.approx(0.5)


def test_rows_added_by_drafts_cost_the_curves_slope_when_the_steps_run_faster_than_it() -> None:
    cost = VerifyCost({1: 10.0, 8: 38.0})  # 4 ms a row
    for _ in range(9):
        cost.observe(1, 5.0)  # the steps without drafts run at half the curve (short contexts)
    assert cost.forward_ms(1) == pytest.approx(5.0) and cost.added_ms(1, 3) == pytest.approx(8.0)  # not 4
    for _ in range(31):
        cost.observe(1, 20.0)  # a slower machine: the added rows slow down with it
    assert cost.added_ms(1, 3) == pytest.approx(16.0)
    spec = planner(slope=4.0)
    for _ in range(9):
        spec.cost.observe(1, 5.0)  # type: ignore[union-attr]
    # a lone 60% token: (1 + 0.6) / (5 + 4) ms < 1 / 5 ms; costed at half the slope it would have paid (1.6 / 7)
    assert spec.plan([offer([0.6])], 1, 1, 63) == [0]
    assert spec.floor(1, 1) == pytest.approx(0.8)


class SlowModel:
    """A forward of T rows takes 2 + T ms; the call numbered `spike` takes 100 ms more (another process ran)."""

    def __init__(self, spike: int) -> None:
        self.calls, self.spike = 0, spike

    def __call__(self, batch: Batch, kv: KVPool) -> torch.Tensor:
        self.calls += 1
        rows = batch.num_tokens
        time.sleep((2 + rows + (100 if self.calls == self.spike else 0)) / 1000)
        return torch.zeros(rows, 4)


def tiny_pool(pages: int = 40) -> KVPool:
    from types import SimpleNamespace

    args = SimpleNamespace(n_layers=1, n_kv_heads=1, head_dim=2)
    return KVPool(args, pages, "cpu", torch.float32)  # type: ignore[arg-type]


@pytest.mark.parametrize("spike", [5, 9, 14])
def test_one_slow_forward_moves_no_point_of_the_curve(spike: int) -> None:
    pool = tiny_pool()
    curve = measure(SlowModel(spike), pool, grid=(1, 2, 4, 8), passes=3, context=32)
    for rows, ms in curve.items():
        assert 2 + rows <= ms < 2 + rows + 20, (rows, ms)  # sleep overshoots a little, never by the spike
    assert len(pool.free) == pool.usable_pages  # the measurement's pages went back


def test_calibration_stays_within_the_context(tiny_model_dir: Path) -> None:
    model, tok = load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)
    engine = Engine(model, tok, max_seq_len=20)  # the rope table and the pool hold 20 positions
    assert engine.calibrate() and engine.auto.cost is not None
    assert max(engine.auto.cost.curve) <= 16 and len(engine.pool.free) == engine.pool.usable_pages


def test_a_pool_without_room_is_not_measured() -> None:
    pool = tiny_pool(pages=2)  # one usable page of 16 slots
    assert list(measure(SlowModel(0), pool, grid=(1, 8, 24), passes=1, context=256)) == [1, 8]
    pool.alloc()
    with pytest.raises(PoolExhausted, match="no free KV slot"):
        measure(SlowModel(0), pool, grid=(1,), passes=1)


def test_cycles_keep_the_median_and_skip_idle_gaps() -> None:
    c = Cycles()
    t = 100.0
    for gap in [0.002] * 8 + [0.050] + [5.0]:  # ms 2 eight times, one slow cycle, one idle gap
        c.forward_ended(t)
        t += gap
        c.forward_began(t)
    assert c.overhead_ms == pytest.approx(2.0)


# ---------------------------------------------------------------- the planner
def planner(slope: float, overhead: float = 0.0) -> AutoSpec:
    """Forward ms = 10 + slope * (rows - 1)."""
    spec = AutoSpec()
    spec.cost = VerifyCost({1: 10.0, 64: 10.0 + 63 * slope})
    spec.cycles.overhead_ms = overhead
    return spec


def offer(q: list[float]) -> Proposal:
    return Proposal("context", 3, q, tokens=list(range(len(q))))


def test_drafts_are_granted_only_where_they_pay() -> None:
    costly = planner(slope=6.0)  # a row is 0.6 of a one-row step: a token must be 60% likely to pay alone
    assert costly.plan([offer([0.5, 0.25, 0.1])], 1, 1, 63) == [0]
    # 4 drafts: (1 + 3.5) tokens / 34 ms beats 3 (3.7 / 28), 5 (5.25 / 40) and none (1 / 10)
    assert costly.plan([offer([0.95, 0.9, 0.85, 0.8, 0.75, 0.7])], 1, 1, 63) == [4]
    cheap = planner(slope=0.5)
    assert cheap.plan([offer([0.5, 0.25, 0.1])], 1, 1, 63) == [3]
    # among 16 streams each row costs a sixteenth of the step's tokens: a 50% draft no longer pays
    batch = [offer([0.5, 0.25])] + [None] * 15
    assert cheap.plan(batch, 16, 16, 48) == [0] + [0] * 15
    assert planner(slope=6.0).plan([offer([0.99] * 16)], 1, 1, 4) == [4]  # no more rows than the step has room for


def test_the_most_likely_tokens_win_across_sequences() -> None:
    spec = planner(slope=1.0)
    grants = spec.plan([offer([0.9, 0.1]), offer([0.99, 0.98, 0.97]), None], 3, 3, 61)
    assert grants == [1, 3, 0]


def test_estimates_that_run_high_are_pulled_down() -> None:
    spec = AutoSpec()
    assert spec.realistic("shared", [0.9, 0.81]) == [0.9, 0.81]  # no checks yet: taken as they are
    for i in range(60):
        spec.checked("shared", 0.9, int(i % 10 < 3))  # 90% expected, 30% came
    q = spec.realistic("shared", [0.9, 0.81, 0.06])
    assert q[0] == pytest.approx(0.3, rel=0.15) and len(q) == 2  # about a third of the estimate; the last cut
    for _ in range(200):
        spec.checked("context", 0.5, 1)  # better than expected: raised, within the range, never past 0.99
    assert spec.realistic("context", [0.5, 0.9]) == [pytest.approx(0.625), 0.99]


def ran(spec: AutoSpec, emitted: int, ms: float) -> None:
    """The planned step ran: `emitted` tokens, and the next forward began ms after its own."""
    spec.outcome(emitted, 100.0, 100.0 + ms / 2000)
    spec.next_forward(100.0 + ms / 1000)


def test_plans_that_do_not_come_true_stop_drafting_at_that_batch_size_until_forgotten() -> None:
    spec = planner(slope=6.0)  # forward ms = 10 + 6 (rows - 1)
    draft = [0.9, 0.85, 0.8]  # (1 + 2.55) tokens / 28 ms against 1 / 10: granted, 1.23x the step without drafts
    assert spec.plan([offer(draft)], 1, 1, 63) == [3]
    ran(spec, 4, 28.0)  # all 3 accepted: better than planned, which raises the plans (within the range)
    assert 1.0 < spec.payoff_factor(1) <= PAYOFF_RANGE[1]
    for _ in range(12):  # then every grant emits 1 token in a forward twice the curve's: a loss each time
        if spec.plan([offer(draft)], 1, 1, 63) == [0]:
            break
        ran(spec, 1, 56.0)
    else:
        pytest.fail("a batch size whose drafts keep losing went on drafting")
    assert spec.payoff_factor(1) < 0.8
    four = [offer([0.99, 0.98, 0.97])] + [None] * 3  # another batch size keeps its own evidence (none yet)
    assert spec.payoff_factor(4) == 1.0 and spec.plan(four, 4, 4, 60) == planner(slope=6.0).plan(four, 4, 4, 60)
    steps = 0
    while spec.plan([offer(draft)], 1, 1, 63) == [0]:  # planned and not granted: the evidence fades, drafting resumes
        steps += 1
        assert steps < 1000, "a batch size that stopped drafting never tried again"
    assert steps > 20  # ... not at once
    spec.discard_plan()
    ran(spec, 0, 1000.0)  # a discarded plan (its step never ran) teaches nothing
    assert spec.plan([offer(draft)], 1, 1, 63) == [3]
    spec.outcome(0, 100.0, 100.028)
    spec.next_forward(101.0)  # an idle second before the next forward: the step's cost is not known
    assert spec.plan([offer(draft)], 1, 1, 63) == [3]


def test_a_step_before_a_prompts_forward_is_charged_the_usual_time_between_forwards() -> None:
    """A single stream's last step is followed by the next request's prompt: the gap holds the turn between requests,
    not the step's own cost (it made the served single stream's payoff ~0.7 where its plans came true)."""
    draft = [0.9, 0.85, 0.8]
    factors = {}
    for rows in (0, 4):  # the next forward: a new prompt's, or the same stream's next step
        spec = planner(slope=6.0, overhead=1.0)
        assert spec.plan([offer(draft)], 1, 1, 63) == [3]
        spec.outcome(4, 100.0, 100.028)  # all accepted, in the curve's 28 ms
        spec.timed(100.090, 100.2, rows)  # 62 ms later
        factors[rows] = spec.payoff_factor(1)
    assert factors[0] > 1.0 > factors[4]


# ---------------------------------------------------------------- one sequence's drafting
class Script:
    """A sequence whose model writes `script`, verified the engine's way: accepted drafts, then the model's token."""

    def __init__(self, spec: AutoSpec, prompt: list[int], script: list[int]) -> None:
        self.spec, self.script = spec, script
        self.context = list(prompt)
        self.drafter = SeqDrafter(spec, len(prompt))

    @property
    def done(self) -> int:
        return len(self.context) - self.drafter.prompt_len

    def step(self) -> int:
        """One step; returns the drafts granted."""
        p = self.drafter.offer(self.context, len(self.script) - self.done - 1)
        n = self.spec.plan([p], 1, 1, 63)[0] if p is not None else 0
        drafts = self.drafter.realise(p, n, self.context) if p is not None and n else []
        want = self.script[self.done : self.done + len(drafts) + 1]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == want[accepted]:
            accepted += 1
        self.context += want[: accepted + 1]
        return len(drafts)


def test_a_failing_source_stops_and_resumes_when_it_matches_again() -> None:
    rng = random.Random(0)
    passage = [rng.randrange(1000, 2000) for _ in range(120)]
    noise = [rng.randrange(3000, 4000) for _ in range(60)]
    script = passage[:60] + noise + passage[60:]  # copies, writes something new, copies again
    run = Script(planner(slope=6.0), [1, *passage, 2], script)
    steps: dict[str, list[int]] = {"first copy": [], "new text": [], "second copy": []}
    while run.done < len(script) - 1:
        phase = "first copy" if run.done < 60 else "new text" if run.done < 120 else "second copy"
        steps[phase].append(run.step())
    assert sum(steps["new text"]) <= 3 * MAX_AUTO_DRAFT  # rejected drafts as the copying stops, then none
    assert sum(g > 0 for g in steps["new text"][3:]) == 0
    assert len(steps["first copy"]) < 20 and len(steps["second copy"]) < 25  # many tokens a step while copying
    assert max(steps["second copy"]) >= 8  # drafting at length again once the copy resumed
    assert len(steps["new text"]) >= 58  # one token a step: nothing to copy


def test_a_drafts_later_tokens_are_as_likely_as_the_longer_match_they_continue() -> None:
    """A copy that has just resumed (a 2-token match) fails often at its first tokens and seldom once it has gone on:
    token i of a draft, its predecessors accepted, continues a match of match + i, and is estimated and counted at
    that length's rate."""
    spec = AutoSpec()
    b2 = bucket(2)  # the bucket of matches of 2-3 tokens
    for _ in range(400):  # engine-wide: matches of 2-3 tokens continue 30% of the time, longer ones 95%
        spec.observe("context", b2, 3, 7)
        for b in (b2 + 1, b2 + 2, b2 + 3):
            spec.observe("context", b, 19, 1)
    rng = random.Random(1)
    passage = [rng.randrange(1000, 2000) for _ in range(30)]
    drafter = SeqDrafter(spec, 32)
    context = [1, *passage, 2, 9, *passage[:2]]  # the copy resumed: its first 2 tokens emitted
    p = drafter.offer(context, 16)
    assert p is not None and p.tokens == passage[2:8]  # 2 matched + SPEC_OFFSET
    ratios = [b / a for a, b in zip(p.raw, p.raw[1:], strict=False)]
    assert p.raw[0] == pytest.approx(spec.rate("context", b2))  # the token after a 2-token match
    assert ratios[0] == pytest.approx(spec.rate("context", b2))  # ... after 3
    assert all(r == pytest.approx(spec.rate("context", b2 + 1)) for r in ratios[1:])  # after 4 to 7: the longer rate
    before = {b: spec.rate("context", b) for b in (b2, b2 + 1)}
    drafter.offer([*context, *passage[2:6], 5], 16)  # 4 of the draft came, then another token: checked
    seq = drafter.rates
    short, longer = seq[("context", b2, False)], seq[("context", b2 + 1, False)]  # decayed counts (SEQ_DECAY a token)
    assert short.hits == short.events == pytest.approx(1 + SEQ_DECAY)  # the tokens after 2 and 3 matched: hits
    assert longer.hits == pytest.approx((1 + SEQ_DECAY) * SEQ_DECAY)
    assert longer.events - longer.hits == pytest.approx(1)  # then a miss
    assert spec.rate("context", b2) > before[b2]  # the engine-wide rates too
    assert spec.rate("context", b2 + 1) < before[b2 + 1]


def test_a_drafts_token_after_a_sentences_end_has_the_rate_of_breaks() -> None:
    """Within a sentence a long copy goes on; after a full stop the reply chooses what to say next: a draft token
    that follows a break (a token ending a sentence or a line) is estimated and counted at the break's rate, the
    others at their own."""
    spec = AutoSpec()
    texts = [f"w{t}" for t in range(2000)]
    texts[1500], texts[1501] = " lamp.", "\n"
    spec.set_breaks(texts)
    assert spec.breaks == {1500, 1501}
    assert ends_break("end.)") and ends_break("? ") and ends_break("a\nb") and not ends_break("3.5x")
    b = bucket(8)
    for _ in range(400):  # engine-wide: within a sentence 98% go on, after a break 40%
        spec.observe("context", b, 49, 1)
        spec.observe("context", b, 2, 3, brk=True)
    assert spec.rate("context", b, brk=True) < 0.5 < 0.95 < spec.rate("context", b)
    passage = [1000 + i for i in range(16)]
    passage[9] = 1500  # a sentence ends at the tenth token
    context = [1, *passage, 2, 7, *passage[:11]]  # the reply copies the passage: 11 tokens so far, past the break
    p = SeqDrafter(spec, 40).offer(context, 16)
    assert p is not None and p.tokens[:5] == passage[11:16]
    ratios = [b / a for a, b in zip(p.raw, p.raw[1:5], strict=False)]  # matches of 12 to 15: one bucket
    assert all(r == pytest.approx(spec.rate("context", b)) for r in ratios)  # no break there
    context = [1, *passage, 2, 7, *passage[:8]]  # 8 copied: the draft's third token follows the break
    drafter = SeqDrafter(spec, 40)
    p = drafter.offer(context, 16)
    assert p is not None and p.tokens[:3] == passage[8:11]
    assert p.raw[1] / p.raw[0] == pytest.approx(spec.rate("context", b))
    assert p.raw[2] / p.raw[1] == pytest.approx(spec.rate("context", b, brk=True))  # the token after the break
    drafter.offer([*context, *passage[8:10], 3, 4], 16)  # the draft's first two came, the one after the break did not
    assert drafter.rates[("context", b, True)].events == pytest.approx(1)
    assert drafter.rates[("context", b, True)].hits == 0
    assert drafter.rates[("context", b, False)].hits == pytest.approx(1 + SEQ_DECAY)
    assert f"context/{b}/break" in spec.info()["rates"]  # type: ignore[operator]


def test_a_copy_that_diverged_at_a_word_resumes_after_it() -> None:
    """The model fixes a word of the text it copies: the bigram after the fix is nowhere in the context, so the copy
    is looked for again just after where it stopped, from the first token the model emits that is found there."""
    spec = AutoSpec()
    rng = random.Random(3)
    passage = [rng.randrange(1000, 2000) for _ in range(30)]
    prompt = [1, *passage, 2, passage[11], 8, 9, 10, 2]  # passage[11] again at the prompt's end
    drafter = SeqDrafter(spec, len(prompt))
    context = [*prompt, *passage[:10]]
    p = drafter.offer(context, 16)
    assert p is not None and p.tokens[0] == passage[10]
    context.append(7)  # the fix, where the copy had passage[10]
    p = drafter.offer(context, 16)
    assert p is None  # 7 is nowhere in the prompt
    context.append(passage[11])  # the copy goes on after the replaced token
    p = drafter.offer(context, 16)
    assert p is not None and p.source == "context" and p.match == 1 and p.tokens[:5] == passage[12:17]
    later = SeqDrafter(spec, len(prompt))  # the same divergence, too far on to resume: the prompt's last occurrence
    context = [*prompt, *passage[:10]]
    later.offer(context, 16)
    context += [7, *[rng.randrange(3000, 4000) for _ in range(RESUME_WITHIN)], passage[11]]
    p = later.offer(context, 16)
    assert p is not None and p.tokens == [8, 9, 10]


def test_a_replys_first_token_is_looked_up_in_the_prompt() -> None:
    """A reply's first token has no bigram in the prompt yet (the prompt's last token is the template's): the
    prompt's last occurrence of it is followed, at match length 1's own rate."""
    spec = AutoSpec()
    prompt = [1, 50, 51, 52, 2, 60, 61, 62, 63, 64, 3, 4]  # an instruction, the text to copy, the template's end
    drafter = SeqDrafter(spec, len(prompt))
    p = drafter.offer([*prompt, 60], 16)
    assert p is not None and p.match == 1 and p.tokens == [61, 62, 63, 64, 3]  # not the template's last token
    assert p.raw[0] == pytest.approx(spec.rate("context", 0))
    assert drafter.offer([*prompt, 60, 99], 16) is None  # 99 is nowhere in the prompt


def test_in_a_large_batch_a_stream_whose_draft_cannot_pay_sits_out_some_steps() -> None:
    spec = AutoSpec()
    rng = random.Random(2)
    passage = [rng.randrange(1000, 2000) for _ in range(40)]
    copying = SeqDrafter(spec, 42)
    context = [1, *passage, 2, 9, *passage[:10]]
    for i in range(6):  # a copy in progress offers every step however many streams there are
        assert copying.offer(context + passage[10 : 10 + i], 16, floor=0.5, rest=4) is not None
    doubtful = SeqDrafter(spec, 42)  # a copy whose first token (under 0.95 likely) cannot pay alone here sits out
    assert doubtful.offer(context, 16, floor=0.95, rest=4) is not None and doubtful.rest == 4
    doubtful.rest = 0  # it looks again: the copy's first token now pays, but no grant came, so the next offer that
    p = doubtful.offer(context, 16, floor=0.5, rest=4)  # cannot pay sits out twice as long
    assert p is not None and doubtful.rest == 0
    assert doubtful.offer(context + passage[10:11], 16, floor=1.0, rest=4) is not None and doubtful.rest == 8
    doubtful.rest = 0  # a grant puts it back to rest
    p = doubtful.offer(context + passage[10:12], 16, floor=0.5, rest=4)
    assert p is not None and doubtful.realise(p, 2, context + passage[10:12]) and doubtful.rest == 0
    assert doubtful.offer(context + passage[10:13], 16, floor=1.0, rest=4) is not None and doubtful.rest == 4
    writing = SeqDrafter(spec, 10)
    text = [rng.randrange(3000, 4000) for _ in range(80)]
    looked = []
    for i in range(70):
        looked.append(writing.rest == 0)
        assert writing.offer(text[: 10 + i], 16, floor=0.5, rest=4) is None
    assert [i for i, x in enumerate(looked) if x] == [0, 5, 14, 31, 64]  # sat out 4, 8, 16, then 32 (REST_MAX)
    alone = SeqDrafter(spec, 10)  # rest 0 (a small batch): it looks every step
    for i in range(5):
        alone.offer(text[: 10 + i], 16, floor=0.9)
        assert alone.rest == 0
    own = passage[:8]
    late = SeqDrafter(spec, 8)
    assert late.offer(own + [7] + own[:3], 16, floor=2.0, rest=2) is not None  # offered, then sits out 2 steps
    assert late.pending and late.offer(own + [7] + own[:4], 16) is None
    came = own + [7] + own  # the copy came on while it sat out: its pending proposal is checked when it looks again
    assert late.offer(came, 16) is None and not late.rates
    late.offer([*came, 5], 16)
    assert late.rates[("context", 1, False)].hits > 0 and late.rates[("context", 2, False)].hits > 0


class WrongModel:
    def __init__(self) -> None:
        self.calls = 0

    def draft(self, context: list[int], k: int) -> list[int]:
        self.calls += 1
        return [999_999] * k


def test_a_failing_draft_model_is_probed_at_growing_intervals() -> None:
    spec = planner(slope=6.0)
    spec.draft_token_ms = 5.0
    model = WrongModel()
    drafter = SeqDrafter(spec, 2, model)
    context = [1, 2]
    probes = []
    for step in range(600):
        p = drafter.offer(context, 8)
        n = spec.plan([p], 1, 1, 63)[0] if p is not None else 0
        if p is not None and n:
            drafter.realise(p, n, context)
            probes.append(step)
        context.append(10_000 + step)  # never what the model drafted
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:2] != [] and all(g >= PROBE_MIN for g in gaps)
    assert gaps == sorted(gaps) and max(gaps) == PROBE_MAX  # doubling to the cap
    assert model.calls == len(probes) <= 20


# ---------------------------------------------------------------- in the engine
def test_drafts_never_evict_an_idle_session(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts get pages only from the free list: a full pool drafts less, it never drops another session's cache."""
    model, tok = load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)

    def sixteen(self: SeqDrafter, context: list[int], room: int, *_: Any) -> Proposal:
        return Proposal("context", 0, [0.9] * 16, tokens=[5] * 16, at=len(context))  # granted in full (flat cost)

    monkeypatch.setattr(SeqDrafter, "offer", sixteen)
    prompt = list(range(40, 60))
    plain, _ = run(Generator(model, tok), GenerationRequest(prompt_ids=prompt, settings=GREEDY, max_new_tokens=10,
                                                            stop_token_ids=[]))
    for pages, drafting in ((5, False), (12, True)):  # 5: the idle session's 3 pages and 2 for the new one, no more
        engine = Engine(model, tok, max_seq_len=96, pool_tokens=pages * 16)
        engine.auto.cost = VerifyCost.flat()
        idle = Generator(model, tok, engine=engine)
        run(idle, GenerationRequest(prompt_ids=list(range(100, 140)), settings=GREEDY, max_new_tokens=8))
        held = engine.cached_ids(idle)
        out, stats = run(Generator(model, tok, engine=engine),
                         GenerationRequest(prompt_ids=prompt, settings=GREEDY, max_new_tokens=10, stop_token_ids=[],
                                           speculative="auto"))
        assert out == plain
        assert engine.cached_ids(idle) == held and len(held) >= 40
        assert (stats.drafted > 0) is drafting, stats


def test_the_engine_reports_how_each_plan_came_true(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step whose plan granted drafts reports the tokens it emitted and when its forward began, and the next
    forward closes its cycle: drafts that are never accepted bring that batch size's payoff down."""
    model, tok = load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)

    prompt = list(range(40, 60))
    plain, _ = run(Generator(model, tok), GenerationRequest(prompt_ids=prompt, settings=GREEDY, max_new_tokens=6,
                                                            stop_token_ids=[]))

    def wrong(self: SeqDrafter, context: list[int], room: int, *_: Any) -> Proposal:
        miss = (plain[len(context) - len(prompt)] + 1) % model.args.vocab_size  # not the token that comes next
        return Proposal("context", 0, [0.9] * 8, tokens=[miss] * 8, at=len(context))

    monkeypatch.setattr(SeqDrafter, "offer", wrong)
    engine = Engine(model, tok, max_seq_len=96)
    engine.auto.cost = VerifyCost.flat()
    outcomes: list[int] = []
    monkeypatch.setattr(engine.auto, "outcome", lambda emitted, began, ended, real=engine.auto.outcome: (
        outcomes.append(emitted), real(emitted, began, ended))[1])
    out, stats = run(Generator(model, tok, engine=engine),
                     GenerationRequest(prompt_ids=prompt, settings=GREEDY, max_new_tokens=6, stop_token_ids=[],
                                       speculative="auto"))
    assert out == plain and stats.drafted > 0 and stats.accepted == 0
    assert outcomes and set(outcomes) == {1}  # each drafted step emitted its one verified token
    assert engine.auto.payoff_factor(1) < 0.75  # from 1: each step got 1 token where it planned 1 + 0.9 a draft


def run(gen: Generator, req: GenerationRequest) -> tuple[list[int], Any]:
    gen.begin_stream(req)
    ids: list[int] = []
    while True:
        res = gen.stream()
        ids += res.token_ids
        if res.eos:
            return ids, res.stats
