"""The batched engine: every running sequence advances in one forward per step, on one paged KV pool.

    engine.fits(request) -> bool                               # admission: its prompt's pages fit now
    engine.add(owner, request) -> (Sequence, StartInfo)       # joins at the next step
    engine.step()                                              # one forward for all; results wait in engine.outbox
    engine.take(seq) -> StreamResult | None                    # what a sequence produced since the last take

The engine is composed (nano-vllm's LLMEngine: a scheduler and a runner): its Scheduler decides who fits and owns the
pages (webchat.engine.scheduler), its Speculation gives each sequence a drafter or the auto mode's offers
(webchat.engine.spec.modes), a sequence's ThinkingState splits and bounds its thinking (webchat.engine.thinking); it
asks each of them, never which kind it has. Each step gathers, per running sequence, one decode token (plus up to k
drafts to verify) or a prefill chunk, into one ragged Batch (webchat.model.batch); prefill chunks share a per-step
token budget, smaller while others decode, so a long prompt does not stall running streams. After the forward each
sequence samples, verifies and emits on its own; a finished one leaves at once and its pages stay with its owner for
the next turn's prefix. The model never counts positions: n_cached advances here. Verification (`_verify`) keeps
exllamav2's rule: a draft is accepted only if it equals the main model's own sample, so speculation never changes the
output.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from webchat.engine import constraint as cst
from webchat.engine.chunking import StepCost
from webchat.engine.events import Stats, TokenInfo
from webchat.engine.images import PromptImages
from webchat.engine.sampling import Choice, RowAsk, RowScan, Sampler, describe, sample_batch
from webchat.engine.scheduler import Retained, Scheduler
from webchat.engine.sequence import GenerationRequest, Sequence, StartInfo, StreamResult
from webchat.engine.settings import MAX_TOP_ALTS
from webchat.engine.spec.modes import Speculation
from webchat.engine.spec.planner import AutoSpec
from webchat.engine.spec.rates import MAX_STEP_ROWS, Proposal
from webchat.engine.thinking import ThinkingState
from webchat.model.batch import Batch, Placed, make_batch
from webchat.model.config import ModelArgs
from webchat.model.kv_cache import PAGE_SIZE, KVPool
from webchat.text.detok import IncrementalDecoder
from webchat.text.stops import StopHolder

PREFILL_CHUNK = 256  # prompt tokens per step when no other sequence is decoding
MIXED_CHUNK = 32  # prompt tokens per step while others decode (bounds their gap between tokens)
# A chunk is also bounded in time: sized from recent steps with prompt rows (webchat.engine.chunking), so a step
# with others decoding takes about MIXED_STEP_S (their gap between tokens stays under half a second on a loaded
# core, where 32 rows of a prompt 7,000 tokens deep take 0.9 s on one thread) and a prompt's step alone about
# PREFILL_STEP_S (what a request arriving meanwhile waits before its own prefill starts; a step's fixed cost, ~0.1 s
# for a scored prompt's float32 rows on one core, is then a quarter of it at most). The output does not depend on
# it: each row's numbers are its own, however the prompt is chunked.
MIXED_STEP_S = 0.25
PREFILL_STEP_S = 0.4
MIN_CHUNK = 8  # below this a step's fixed cost (the weights read once) outweighs its rows
# A prompt's step alone takes at least PREFILL_MIN rows: each step reads every weight and the whole KV cache so far
# once, whatever its rows, and where a row is slow (a big model, a deep prompt) the time bound alone would cut the
# chunk to the floor. Llama-3.2-3B's shape (Q4_K_M, int8, 2 cores of a Zen 4) 6,144 tokens deep: 256 rows in 8-row
# steps 10.0 s, 16 8.0, 32 7.3, 64 6.9, 256 7.1 (the default model's: 2.4 s at 16, 2.2 at 64 and at 256). A request
# arriving meanwhile waits one such step (a second or two on the 3B) before its own prefill starts.
PREFILL_MIN = 64
MAX_FORCED = 16  # forced tokens (a grammar's, a thinking budget's closing) verified in one forward


class Model(Protocol):
    """What the engine needs of webchat.model.transformer.Transformer."""

    args: ModelArgs
    sampler_factory: Callable[..., object] | None  # installed by a backend (webchat.kernels.cuda.graphs)
    row_scan: RowScan | None  # installed by webchat.kernels.backend where the C++ kernels are built
    suffix_index: Callable[..., Any] | None  # likewise: the auto planner's suffix index in C++ (engine.spec.suffix)

    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    def __call__(self, batch: Batch, kv: KVPool) -> torch.Tensor: ...
    def new_pool(self, n_tokens: int, page_size: int | None = None) -> KVPool: ...
    def ensure_rope(self, n_positions: int) -> None: ...
    def truncated(self, n_layers: int) -> Model: ...


class Tokenizer(Protocol):
    vocab_size: int

    @property
    def stop_token_ids(self) -> list[int]: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def id_to_text(self, token_id: int) -> str: ...


@dataclass
class _Row:
    """One sequence's share of a step: feed tokens at position start; logits for the last or for all of them."""

    seq: Sequence
    feed: list[int]
    drafts: list[int] = field(default_factory=list)
    sample: bool = True  # False: a prefill chunk that does not finish the prompt
    forced: bool = False  # drafts are forced tokens (not speculation: not counted as drafted or accepted)
    score: bool = False  # a prefill chunk of a request that scores its prompt: logits for every row
    plan: bool = False  # an auto sequence's decode row: its drafts come from the step's plan (_plan_drafts)
    placed: Placed | None = None  # a prefill chunk's image slots: their rows (webchat.engine.images)

    def logit_offsets(self) -> list[int]:
        """The feed positions whose logits this row wants (make_batch's logit_offsets)."""
        if self.score or (self.sample and self.drafts):
            return list(range(len(self.feed)))
        return [-1] if self.sample else []

    @property
    def n_sample(self) -> int:
        """Logits rows that sample a token (the last ones of logit_offsets)."""
        return 0 if not self.sample else len(self.feed) if self.drafts else 1


class Engine:
    """Owns the model, its Scheduler (pages and admission) and its Speculation; sequences come and go between steps
    (continuous batching)."""

    def __init__(self, model: Model, tokenizer: Tokenizer, max_seq_len: int | None = None,
                 pool_tokens: int | None = None, page_size: int = PAGE_SIZE, draft_model: Model | None = None,
                 self_draft_layers: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 mixed_chunk: int = MIXED_CHUNK) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.device = model.device  # read once: a module attribute lookup on every step otherwise
        context = min(max_seq_len or model.args.max_seq_len, model.args.max_seq_len)
        pool = model.new_pool(pool_tokens or context, page_size)
        capacity = min(context, pool.usable_pages * page_size)  # positions one sequence may reach
        model.ensure_rope(capacity)
        self.scheduler = Scheduler(pool, capacity)
        self.spec = Speculation(model, pool, capacity, draft_model, self_draft_layers,  # the auto planner's suffix
                                native_index=model.suffix_index,  # index in C++ where the backend installed it
                                breaks=[tokenizer.id_to_text(t) for t in range(tokenizer.vocab_size)])
        self.draft_model = draft_model
        self.prefill_chunk, self.mixed_chunk = prefill_chunk, mixed_chunk
        # recent steps with prompt rows, timed; those with a scored prompt's float32 rows apart (engine.chunking)
        self.step_cost = {False: StepCost(), True: StepCost()}
        self.outbox: dict[Sequence, StreamResult] = {}
        self.steps = 0

    # the parts' state, as the worker, the server's info and the benches read it
    @property
    def pool(self) -> KVPool:
        return self.scheduler.pool

    @property
    def capacity(self) -> int:
        return self.scheduler.capacity

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def retained(self) -> OrderedDict[object, Retained]:
        return self.scheduler.retained

    @property
    def first_logits(self) -> OrderedDict[tuple[int, ...], torch.Tensor]:
        return self.scheduler.first_logits

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def auto(self) -> AutoSpec:
        return self.spec.auto

    # ------------------------------------------------------------------ requests
    def fits(self, req: GenerationRequest) -> bool:
        """Whether a new request's prompt fits beside the running sequences' pages now (the scheduler decides)."""
        return self.scheduler.fits(len(req.prompt_ids))

    def add(self, owner: object, req: GenerationRequest) -> tuple[Sequence, StartInfo]:
        """Check the request, reuse the longest cached prefix (the owner's last turn, or any pages the pool still holds
        for it, to the token), queue it."""
        self._reap()
        self._check(req)
        prompt = list(req.prompt_ids)
        scoring = req.prompt_logprobs is not None  # every prompt row's logits are wanted: nothing is reused
        images = PromptImages(req.images, len(prompt)) if req.images else None
        keyed = images.cache_ids(prompt) if images is not None else None  # an image's pages keyed by its content
        table, reused, first = self.scheduler.admit(owner, keyed or prompt, scoring)
        sampler = self._sampler(req)
        stop_ids = self.tokenizer.stop_token_ids if req.stop_token_ids is None else req.stop_token_ids
        drafter, offers = self.spec.for_request(owner, req.speculative, len(prompt))
        seq = Sequence(req=req, sampler=sampler, decoder=IncrementalDecoder(self.tokenizer.token_bytes),
                       holder=StopHolder(req.stop_strings), stop_ids=frozenset(stop_ids), tokens=prompt, table=table,
                       stats=Stats(prompt_tokens=len(prompt), reused_tokens=reused), drafter=drafter,
                       limit=self.capacity, n_cached=reused, owner=owner, first_logits=first, offers=offers,
                       thinking=None if req.thinking is None else ThinkingState(req.thinking),
                       images=images, keyed_prompt=keyed)
        seq.stats.image_tokens = images.n_tokens if images is not None else 0
        self._spend(seq)  # a prompt that opened thinking with a budget of 0: closed at once
        if scoring:  # each prompt token with the text it adds; scored as the prefill reaches it (the first never)
            text = IncrementalDecoder(self.tokenizer.token_bytes)
            seq.scored = [TokenInfo(id=t, piece=text.push(t)) for t in prompt]
        self.running.append(seq)
        return seq, StartInfo(prompt_tokens=len(prompt), reused_tokens=reused, seed=sampler.seed)

    def take(self, seq: Sequence) -> StreamResult | None:
        return self.outbox.pop(seq, None)

    def close(self, owner: object) -> None:
        """Thread-safe: the owner is gone; its running sequence ends and its pages go back at the next step."""
        self.scheduler.close(owner)

    def reset(self) -> None:
        """Between runs: every idle owner's pages go back and cached prefixes are forgotten (a cold start)."""
        self._reap()
        self.scheduler.reset()

    def cached_ids(self, owner: object) -> list[int]:
        """The tokens whose k/v the owner holds (its running sequence's or its last turn's)."""
        return self.scheduler.cached_ids(owner)

    def pool_info(self) -> dict[str, int | str]:
        return self.scheduler.pool_info()

    def calibrate(self) -> bool:
        """Measure what verify rows cost here, for the auto mode's plans (webchat.engine.spec.modes)."""
        return self.spec.calibrate(self.steps)

    def calibration(self) -> Generator[None, None, bool]:
        """calibrate(), one forward a step."""
        return self.spec.calibration(self.steps)

    def _reap(self) -> None:
        gone, ended = self.scheduler.reap()
        for seq in ended:
            self.outbox.pop(seq, None)
        for owner in gone:
            self.spec.forget(owner)

    def _check(self, req: GenerationRequest) -> None:
        vocab = self.model.args.vocab_size
        ids = req.prompt_ids
        if not ids:
            raise ValueError("prompt_ids must hold at least one token, got none")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab - 1}], got {bad!r}")
        if len(ids) > self.capacity:
            raise ValueError(f"prompt is {len(ids)} tokens; the cache holds at most {self.capacity}")
        if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_TOP_ALTS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_ALTS}], got {req.prompt_logprobs}")
        least = 0 if req.prompt_logprobs is not None else 1  # a prompt scored only generates nothing
        if req.max_new_tokens < least:
            raise ValueError(f"max_new_tokens must be at least {least}, got {req.max_new_tokens}")
        if not 0 <= req.top_alts <= MAX_TOP_ALTS:
            raise ValueError(f"top_alts must be in [0, {MAX_TOP_ALTS}], got {req.top_alts}")
        if req.draft_tokens < 1:
            raise ValueError(f"draft_tokens must be at least 1, got {req.draft_tokens}")
        self.spec.check(req.speculative)

    def _sampler(self, req: GenerationRequest) -> Sampler:
        factory = self.model.sampler_factory
        if factory is None:
            return Sampler(req.settings, self.model.args.vocab_size)
        sampler = factory(req.settings, self.model.args.vocab_size)
        if not isinstance(sampler, Sampler):
            raise TypeError(f"the model's sampler_factory gave {type(sampler).__name__}, not a Sampler")
        return sampler

    def _chunk_budget(self, decoding: int, scored: bool) -> int:
        """Prompt rows this step may take: the chunk size, less where recent steps say it would take too long, down to
        a floor (MIN_CHUNK beside a stream, PREFILL_MIN alone)."""
        most, aim = (self.mixed_chunk, MIXED_STEP_S) if decoding else (self.prefill_chunk, PREFILL_STEP_S)
        rows = self.step_cost[scored].rows_within(aim)
        fits = most if rows is None else rows - decoding
        if fits >= most:
            return most
        # a power of two: a handful of row counts, distinct enough for StepCost's line to part fixed from per-row cost;
        # beside a stream the one under the fit (its gap between tokens stays under the aim), a prompt's step alone the
        # nearest (within a factor of 1.41 of the aim: the floor would halve a deep prompt's chunks, each step's fixed
        # cost then paid twice as often)
        fit = max(1, fits)
        chunk = 1 << (fit.bit_length() - 1)
        if not decoding and fit * fit >= 2 * chunk * chunk:
            chunk *= 2
        return max(min(MIN_CHUNK if decoding else PREFILL_MIN, most), min(chunk, most))

    @staticmethod
    def _spend(seq: Sequence) -> None:
        """Thinking that reached its budget is closed: its closing tokens are forced next."""
        if seq.thinking is not None:
            seq.thinking.spend(bool(seq.decoder.pending()))

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        """One forward for every running sequence; results merge into the outbox."""
        self._reap()
        rows: list[_Row] = []
        decoding = [s for s in self.running if not s.prefilling]
        prefilling = [s for s in self.running if s.prefilling]
        scored = bool(prefilling) and prefilling[0].req.prompt_logprobs is not None  # the chunk's sequence, first
        budget = self._chunk_budget(len(decoding), scored)
        for seq in decoding + prefilling:
            out = StreamResult()
            if seq.cancel.is_set():
                seq.end(out, "cancelled", None)
            elif not seq.prefilling and len(seq.tokens) >= seq.limit:
                seq.end(out, "context_full", None)
            elif seq.first_logits is not None and seq.n_cached == len(seq.tokens):
                self._first_from_kept(seq)
            elif seq.prefilling or seq.n_cached < len(seq.tokens) - 1:  # the prompt, or recomputing after preemption
                if not seq.table.pages and seq.n_cached == 0 and seq.req.prompt_logprobs is None:
                    seq.n_cached = self.scheduler.reuse(seq.table, seq.cache_ids, len(seq.tokens) - 1)
                    seq.table.truncate(seq.n_cached)
                end = len(seq.tokens) if seq.prefilling else len(seq.tokens) - 1
                n = min(end - seq.n_cached, budget)
                placed = None
                if n > 0 and seq.images is not None:  # an image's run of slots in one chunk, its rows made first
                    n = seq.images.chunk_end(seq.n_cached, seq.n_cached + n) - seq.n_cached
                    try:
                        placed = self._placed(seq, n)
                    except Exception as exc:  # noqa: BLE001 - an encoder's failure ends its own request
                        self._fail(seq, out, exc, "internal")
                        n = 0
                if n > 0:
                    budget -= n
                    last = seq.prefilling and n == end - seq.n_cached
                    rows.append(_Row(seq, seq.tokens[seq.n_cached : seq.n_cached + n],
                                     sample=last and seq.req.max_new_tokens > 0,
                                     score=seq.prefilling and seq.req.prompt_logprobs is not None, placed=placed))
            else:
                try:
                    rows.append(self._decode_row(seq))
                except cst.ConstraintError as exc:
                    self._fail(seq, out, exc)
            if out.eos:
                self._post(seq, out)
        self._plan_drafts(rows)
        rows = self._reserve(rows)
        if rows:
            self._forward(rows)
        self.scheduler.running = [s for s in self.running if not s.done]
        self.steps += 1

    @staticmethod
    def _placed(seq: Sequence, n: int) -> Placed | None:
        """The image rows of a prefill chunk of n tokens, its images encoded first (here, on the device thread)."""
        assert seq.images is not None
        start = seq.n_cached
        seq.stats.encode_ms += seq.images.ensure(start, start + n) * 1000
        return seq.images.placed(start, n)

    def _first_from_kept(self, seq: Sequence) -> None:
        """A prompt whose k/v the pool holds whole and whose last row's logits were kept: its first token, sampled from
        them, with no forward (the rest of the step runs as ever)."""
        logits, seq.first_logits = seq.first_logits, None
        assert logits is not None
        out = StreamResult()
        self._prompt_done(seq, out)
        if not seq.done:
            try:
                self._verify(seq, out, [], logits[None], [self._sample(seq, logits)])
            except cst.ConstraintError as exc:
                self._fail(seq, out, exc)
        self._post(seq, out)

    @staticmethod
    def _prompt_done(seq: Sequence, out: StreamResult) -> None:
        """The whole prompt is in the cache: its prefill time, its scores when asked for, and the end if nothing is to
        be generated (a prompt scored only) or it fills the context."""
        seq.stats.prefill_ms = (time.perf_counter() - seq.t_begin) * 1000
        if seq.req.prompt_logprobs is not None:
            out.prompt = seq.scored
        if seq.req.max_new_tokens == 0:
            seq.end(out, "max_new_tokens", None)
        elif len(seq.tokens) >= seq.limit:
            seq.end(out, "context_full", None)


    def _reserve(self, rows: list[_Row]) -> list[_Row]:
        """Pages for every row's new tokens (the scheduler preempts the newest sequence when the pool runs out): the
        rows that keep their place, oldest sequence first."""
        order = {seq: i for i, seq in enumerate(self.running)}
        rows = sorted(rows, key=lambda r: order[r.seq])
        return [rows[i] for i in self.scheduler.reserve([(r.seq, len(r.feed)) for r in rows])]

    def _decode_row(self, seq: Sequence) -> _Row:
        pending = seq.tokens[seq.n_cached :]
        assert len(pending) == 1, f"a decoding sequence has one pending token, got {len(pending)}"
        req = seq.req
        room = self._room(seq)
        forced = self._forced(seq)[: max(0, min(room, MAX_FORCED))]
        if forced:  # verified like drafts, and the mask makes every one the sample: tokens without a forward each
            return _Row(seq, pending + forced, forced, forced=True)
        if seq.offers is not None:
            return _Row(seq, pending, plan=True)
        k = min(req.draft_tokens, room)
        drafts = seq.drafter.propose(seq, k) if seq.drafter is not None and k > 0 else []
        seq.stats.drafted += len(drafts)
        return _Row(seq, pending + drafts, drafts)

    @staticmethod
    def _room(seq: Sequence) -> int:
        """Tokens a decoding sequence may add after its pending one (its max_new_tokens, the context)."""
        return min(seq.req.max_new_tokens - seq.stats.new_tokens - 1, seq.limit - len(seq.tokens) - 1)

    def _plan_drafts(self, rows: list[_Row]) -> None:
        """The auto sequences' drafts for this step: as many as pay for their verify rows (webchat.engine.spec.planner),
        and none where the pool's free pages could not hold them without evicting anyone."""
        self.auto.discard_plan()
        planned = [r for r in rows if r.plan]
        if not planned or (self.auto.cost is None and not self.calibrate()):
            return
        base = [r for r in rows if not r.seq.prefilling]
        base_rows = sum(len(r.feed) for r in base)
        base_tokens = sum(1 + len(r.drafts) * r.forced for r in base if r.sample)
        rest = len(planned) // 4  # 4 or more streams: one whose draft cannot pay sits out this many steps
        floor = self.auto.floor(base_rows, base_tokens) if rest else 0.0
        offers: list[Proposal | None] = []
        for r in planned:
            assert r.seq.offers is not None  # a plan row's sequence has offers (_decode_row)
            offers.append(r.seq.offers.offer(r.seq.tokens, self._room(r.seq), not self._batch_verify(r.seq),
                                             floor, rest))
        grants = self.auto.plan(offers, base_rows, base_tokens, MAX_STEP_ROWS - sum(len(r.feed) for r in rows))
        if any(grants) and not self._pages_free(rows, planned, grants):
            self.auto.discard_plan()
            return
        for r, p, n in zip(planned, offers, grants, strict=True):
            if n and p is not None and r.seq.offers is not None:
                r.drafts = r.seq.offers.realise(p, n, r.seq.tokens)
                r.feed = r.feed + r.drafts
                r.seq.stats.drafted += len(r.drafts)

    def _pages_free(self, rows: list[_Row], planned: list[_Row], grants: list[int]) -> bool:
        """Whether the pool's free pages hold every row's new tokens and the granted drafts."""
        ps = self.pool.page_size

        def new_pages(r: _Row, extra: int) -> int:
            return max(0, -(-(r.seq.n_cached + len(r.feed) + extra) // ps) - len(r.seq.table.pages))

        need = sum(new_pages(r, 0) for r in rows)
        need += sum(new_pages(r, n) - new_pages(r, 0) for r, n in zip(planned, grants, strict=True))
        return self.scheduler.pages_free(need)

    @staticmethod
    def _forced(seq: Sequence) -> list[int]:
        """Tokens nothing but the request decides next: a thinking budget's closing, or the grammar's only way on."""
        if seq.forced:
            return list(seq.forced)
        if seq.grammar_active:
            assert seq.req.constraint is not None
            return seq.req.constraint.forced()
        return []

    def _forward(self, rows: list[_Row]) -> None:
        spec = []
        for r in rows:
            r.seq.table.ensure(r.seq.n_cached + len(r.feed))
            spec.append((r.feed, r.seq.n_cached, r.seq.table.pages, r.logit_offsets()))
        # a prompt's positions: computed alike however the prompt is chunked, recomputed alike after a preemption
        ends = [r.seq.stats.prompt_tokens for r in rows]
        placed = [r.placed for r in rows] if any(r.placed is not None for r in rows) else None
        # a prompt scored runs its prompt rows at float32 whatever the precision, its first pass and any recompute
        # alike (its log-probabilities are the model's; docs/quant.md, "Scores are exact")
        exact = [r.seq.req.prompt_logprobs is not None for r in rows]
        began = time.perf_counter()
        batch = make_batch(spec, self.pool.page_size, self.device, ends, placed, exact)
        logits = self.model(batch, self.pool)  # (R, vocab)
        ended = time.perf_counter()
        decode_only = not any(r.seq.prefilling for r in rows)
        fed = sum(len(r.feed) for r in rows)
        self.auto.timed(began, ended, fed if decode_only else 0)
        if not decode_only:
            self.step_cost[any(exact)].add(fed, ended - began)
        at, todo = 0, []  # (row, its first sampling logits row, how many it samples, its results)
        for r in rows:
            seq, out = r.seq, StreamResult()
            n_logits, n_rows = len(r.logit_offsets()), r.n_sample
            if r.score:
                self._score(seq, logits, at, seq.n_cached, n_logits)
            seq.n_cached += len(r.feed)
            first = at + n_logits - n_rows
            if seq.prefilling and seq.n_cached == len(seq.tokens):  # the whole prompt is in
                if r.sample:
                    self.scheduler.keep_first(seq.cache_ids, logits[first])
                self._prompt_done(seq, out)
            todo.append((r, first, n_rows if not seq.done else 0, out))
            at += n_logits
        # one call samples every sequence's first row, and a greedy sequence's verify rows too (they draw nothing);
        # a sampled or masked sequence's verify row is sampled only once the draft before it is accepted, so each
        # random stream draws exactly what it would alone, and each mask is the constraint's after what came before
        at_rows: list[int] = []
        asks: list[RowAsk] = []
        failed: set[Sequence] = set()  # a constraint that cannot go on ends its own sequence, never the step
        for r, first, n, out in todo:
            k = n if self._batch_verify(r.seq) else min(n, 1)
            if not k:
                continue
            try:
                ask = self._ask(r.seq)
            except cst.ConstraintError as exc:
                self._fail(r.seq, out, exc)
                failed.add(r.seq)
                continue
            at_rows += range(first, first + k)
            asks += [ask] * k
        picked = logits if at_rows == list(range(logits.shape[0])) else logits[  # no copy when every row is asked
            torch.tensor(at_rows, dtype=torch.long, device=logits.device)]
        choices = iter(sample_batch(picked, asks, self.model.row_scan) if asks else [])
        judged = decode_only and self.auto.planned  # how the plan came true (a step with prompt rows: not planned for)
        before = sum(len(r.seq.tokens) for r in rows) if judged else 0
        for r, first, n, out in todo:
            if n and r.seq not in failed:
                k = n if self._batch_verify(r.seq) else 1
                sampled = [next(choices) for _ in range(k)]
                try:
                    self._verify(r.seq, out, r.drafts, logits, sampled, first, not r.forced)
                except cst.ConstraintError as exc:
                    self._fail(r.seq, out, exc)
            r.seq.table.register(r.seq.cache_ids, r.seq.n_cached)
            self._post(r.seq, out)
        if judged:
            self.auto.outcome(sum(len(r.seq.tokens) for r in rows) - before, began, ended)

    @staticmethod
    def _batch_verify(seq: Sequence) -> bool:
        """A greedy sequence that no mask can reach has its verify rows all sampled in the step's one call (they draw
        nothing); where a grammar or a reasoning budget may mask a row, each row's mask follows the tokens before."""
        return (seq.sampler.settings.greedy and seq.req.constraint is None
                and (seq.thinking is None or not seq.thinking.may_force))

    def _score(self, seq: Sequence, logits: torch.Tensor, at: int, start: int, n: int) -> None:
        """A scored prefill chunk: logits rows at..at+n-1 are positions start..start+n-1, and row j tells how likely
        the prompt's token at start+j+1 was (the last row of the prompt's last chunk predicts the reply instead)."""
        prompt = seq.stats.prompt_tokens
        m = min(n, prompt - 1 - start)  # rows that predict a prompt token
        if m <= 0:
            return
        k = seq.req.prompt_logprobs or 0
        found = describe(logits, list(range(at, at + m)), seq.tokens[start + 1 : start + 1 + m], k, self.model.row_scan)
        for j, c in enumerate(found):
            info = seq.scored[start + 1 + j]
            info.prob, info.rank = c.prob, c.rank
            info.top = [(t, self.tokenizer.id_to_text(t), p) for t, p in c.top]

    def _verify(self, seq: Sequence, out: StreamResult, drafts: list[int], logits: torch.Tensor,
                sampled: list[Choice], first: int = 0, speculated: bool = True) -> None:
        """Take row i's sample (i = 0..len(drafts), logits row first + i) while the previous one equals draft i - 1
        (exllamav2's rule); rows past `sampled` (the rows sampled already) are sampled here, only when reached.
        speculated: the drafts were a drafter's guesses (counted in the stats), not forced tokens."""
        base = seq.n_cached - len(drafts)  # tokens[:base] are in the cache for good (the fed pending token included)
        accepted = 0
        for i in range(len(drafts) + 1):
            choice = sampled[i] if i < len(sampled) else self._sample(seq, logits[first + i])
            self._emit(seq, out, choice)
            if seq.done or i == len(drafts) or choice.token != drafts[i]:
                break
            accepted += 1
        seq.stats.accepted += accepted if speculated else 0
        if drafts:
            seq.n_cached = base + accepted  # pending + accepted drafts; the last sample is the new pending token
            seq.table.truncate(seq.n_cached)

    @staticmethod
    def _fail(seq: Sequence, out: StreamResult, exc: Exception, code: str = "grammar") -> None:
        """The sequence's constraint (or its image's encoder) cannot go on: it ends with the error (`grammar`,
        `internal`), the others carry on. Its pages go (the k/v of drafts fed this step may be in them), its tokens so
        far are delivered."""
        seq.n_cached = 0
        seq.table.truncate(0)
        seq.end(out, "error", None)
        out.error = (code, str(exc) if code == "grammar" else f"{type(exc).__name__}: {exc}")

    def _ask(self, seq: Sequence) -> RowAsk:
        req = seq.req
        return RowAsk(seq.sampler, seq.tokens, top_alts=req.top_alts if req.return_probs else 0,
                      want_probs=req.return_probs, want_logits=req.return_logits, mask=self._mask(seq))

    def _sample(self, seq: Sequence, row: torch.Tensor) -> Choice:
        a = self._ask(seq)
        return seq.sampler.sample(row, a.history, a.top_alts, a.want_probs, a.want_logits, a.mask)

    def _mask(self, seq: Sequence) -> torch.Tensor | None:
        """The tokens allowed next (constraint's bitmask), None for all: the next forced token, else the grammar's."""
        vocab = self.model.args.vocab_size
        if seq.forced:
            return cst.only(seq.forced[:1], vocab)
        if not seq.grammar_active:
            return None
        assert seq.req.constraint is not None
        bits = cst.empty_mask(vocab)
        return bits if seq.req.constraint.mask(bits) else None

    def _emit(self, seq: Sequence, out: StreamResult, c: Choice) -> None:
        """Append the sampled token; end the sequence when a stop condition holds."""
        seq.tokens.append(c.token)
        seq.stats.new_tokens += 1
        if seq.stats.new_tokens == 1:
            seq.t_first = time.perf_counter()
            seq.stats.ttft_ms = (seq.t_first - seq.t_begin) * 1000
        if seq.forced and seq.thinking is not None:  # the mask allowed this token alone
            seq.thinking.took(c.token)
        elif seq.grammar_active and c.token not in seq.stop_ids:  # decided before the token moves the split on
            assert seq.req.constraint is not None
            seq.req.constraint.accept(c.token)
        info = TokenInfo(id=c.token, piece="", prob=c.prob, sampled_prob=c.sampled_prob, rank=c.rank,
                         top=[(t, self.tokenizer.id_to_text(t), p) for t, p in c.top], logits=c.logits,
                         forbidden=c.forbidden)
        if c.token in seq.stop_ids:  # no text; its scores stay for a transport that lists it (the legacy echo)
            seq.end(out, "stop_token", c.token)
            out.stop_info = info
            return
        released = seq.holder.push(info, seq.decoder.push(c.token))
        seq.release(out, released.items)
        if released.stop is not None:
            seq.end(out, "stop_string", released.stop)
        elif seq.stats.new_tokens >= seq.req.max_new_tokens:
            seq.end(out, "max_new_tokens", None)
        else:
            self._spend(seq)


    def _post(self, seq: Sequence, out: StreamResult) -> None:
        if seq in self.outbox:
            self.outbox[seq].merge(out)
        else:
            self.outbox[seq] = out
        if seq.done:
            self.scheduler.retire(seq)
            if seq.offers is not None:  # its last proposals checked, its output shared
                seq.offers.finish(seq.tokens)
            else:
                self.auto.remember(seq.tokens[seq.stats.prompt_tokens :])
