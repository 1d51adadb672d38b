"""Admission and the pages' lifecycle of the batched engine (webchat.engine.engine), the half of Engine that takes
requests in and gives pages back:

    engine.fits(request) -> bool                               # its prompt's pages fit beside the running ones now
    engine.add(owner, request) -> (Sequence, StartInfo)       # checked, its cached prefix reused, queued
    engine.take(seq) -> StreamResult | None                    # what a sequence produced since the last take
    engine.close(owner) / engine.reset()                       # an owner gone (any thread) / a cold start

A finished turn's pages stay with its owner (Retained) for the next turn's prefix until the pool needs them (least
recently used first, `_evict_idle`, which the pool calls); any other owner's registered pages serve a prompt that
shares them, to the token (`_reuse`); a prompt's last-row logits are kept beside its pages (`_keep_first`), so the
same prompt again samples its first token with no forward. The step itself (gathering rows, the forward, sampling,
verifying, emitting; `_reserve` growing pages and preempting when the pool runs out) is webchat.engine.engine's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from webchat.engine.adaptive import AutoSpec, SeqDrafter
from webchat.engine.events import Stats, TokenInfo
from webchat.engine.sampling import RowScan, Sampler
from webchat.engine.sequence import GenerationRequest, Sequence, StartInfo, StreamResult
from webchat.engine.settings import MAX_TOP_ALTS
from webchat.engine.speculative import MODES, Drafter, ModelDrafter, NgramDrafter, SelfDrafter, common_prefix
from webchat.model.batch import Batch
from webchat.model.config import ModelArgs
from webchat.model.kv_cache import ROOT, KVPool, PageTable, PoolExhausted
from webchat.text.detok import IncrementalDecoder
from webchat.text.reasoning import PartSplitter
from webchat.text.stops import StopHolder


class Model(Protocol):
    """What the engine needs of webchat.model.transformer.Transformer."""

    args: ModelArgs
    sampler_factory: Callable[..., object] | None  # installed by a backend (webchat.kernels.cuda.graphs)
    row_scan: RowScan | None  # installed by webchat.model.loader where the C++ kernels are built
    suffix_index: Callable[..., Any] | None  # likewise: the auto planner's suffix index in C++ (engine.suffix)

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
class Retained:
    """A finished turn's pages, kept for its owner's next turn: k/v of ids[i] at position i."""

    table: PageTable
    ids: list[int]


def spend_budget(seq: Sequence) -> None:
    """Thinking that reached the request's reasoning budget is closed: its closing tokens are forced next."""
    r = seq.req.reasoning
    if (r is not None and r.budget is not None and not seq.budget_spent and seq.splitter is not None
            and seq.splitter.part == "thinking" and seq.splitter.thinking_tokens >= r.budget
            and not seq.decoder.pending()):  # never inside a character split over byte tokens
        seq.force, seq.budget_spent = list(r.close), True


class Admission:
    """Engine's requests and pages (Engine inherits it). The state below is set by Engine.__init__."""

    model: Model
    tokenizer: Tokenizer
    pool: KVPool
    capacity: int  # positions one sequence may reach
    draft_model: Model | None
    self_draft: SelfDrafter
    running: list[Sequence]
    outbox: dict[Sequence, StreamResult]
    retained: OrderedDict[object, Retained]  # owner -> its last turn, oldest first
    auto: AutoSpec
    first_logits: OrderedDict[tuple[int, ...], torch.Tensor]
    first_logits_bytes: int
    _drafters: dict[tuple[int, str], Drafter]
    _closing: list[object]

    # ------------------------------------------------------------------ requests
    def fits(self, req: GenerationRequest) -> bool:
        """Whether a new request's prompt fits beside the running sequences' pages now, with a page each to grow into
        (vLLM's allocate_slots): the one place admission is decided. Pages grow on demand as sequences generate; when
        the pool runs out mid-step the newest sequence is preempted and recomputed later (`_reserve`)."""
        if not self.running:
            return True
        ps = self.pool.page_size  # each running sequence: the pages it holds, or will for its tokens so far
        held = sum(max(len(s.table.pages), -(-(len(s.tokens) + 1) // ps)) for s in self.running)
        need = -(-(min(len(req.prompt_ids), self.capacity) + 1) // ps)
        return held + need + len(self.running) <= self.pool.usable_pages

    def add(self, owner: object, req: GenerationRequest) -> tuple[Sequence, StartInfo]:
        """Check the request, reuse the longest cached prefix (the owner's last turn, or any pages the pool still holds
        for it, to the token), queue it."""
        self._reap()
        self._check(req)
        prompt = list(req.prompt_ids)
        for seq in self.running:
            if seq.owner is owner:
                raise RuntimeError("this handle already has a sequence running")
        kept = self.retained.pop(owner, None)
        scoring = req.prompt_logprobs is not None  # every prompt row's logits are wanted: nothing is reused
        first = None if scoring else self.first_logits.get(tuple(prompt))
        most = 0 if scoring else len(prompt) if first is not None else len(prompt) - 1  # logits kept: the whole prompt
        own = min(common_prefix(kept.ids, prompt), most) if kept is not None else 0
        table = PageTable(self.pool)
        reused = self._reuse(table, prompt, most, keep=kept.table.pages if kept is not None else [])
        if kept is not None and own >= reused:
            table.release()
            table, reused = kept.table, own
        elif kept is not None:
            kept.table.release(kept.ids)
        table.truncate(reused)
        sampler = self._sampler(req)
        stop_ids = self.tokenizer.stop_token_ids if req.stop_token_ids is None else req.stop_token_ids
        seq = Sequence(req=req, sampler=sampler, decoder=IncrementalDecoder(self.tokenizer.token_bytes),
                       holder=StopHolder(req.stop_strings), stop_ids=frozenset(stop_ids), tokens=prompt, table=table,
                       stats=Stats(prompt_tokens=len(prompt), reused_tokens=reused),
                       drafter=self._drafter(owner, req.speculative, len(prompt)), limit=self.capacity,
                       n_cached=reused,
                       owner=owner, first_logits=first if reused == len(prompt) else None,
                       splitter=None if req.reasoning is None else PartSplitter(req.reasoning.markers,
                                                                               req.reasoning.inside))
        spend_budget(seq)  # a prompt that opened thinking with a budget of 0: closed at once
        if scoring:  # each prompt token with the text it adds; scored as the prefill reaches it (the first never)
            text = IncrementalDecoder(self.tokenizer.token_bytes)
            seq.scored = [TokenInfo(id=t, piece=text.push(t)) for t in prompt]
        if first is not None:
            self.first_logits.move_to_end(tuple(prompt))
        self.running.append(seq)
        return seq, StartInfo(prompt_tokens=len(prompt), reused_tokens=reused, seed=sampler.seed)

    def _reuse(self, table: PageTable, tokens: list[int], most: int, keep: list[int] | None = None) -> int:
        """Fill an empty table with the pool's longest cached prefix of tokens (at most `most` of them): whole
        registered pages held as they are, then the page after them that shares the most next tokens, copied (its
        later slots will be rewritten). Returns how many tokens are reused. `keep`: pages not to copy from (an
        owner's own last turn, whose pages it may still keep)."""
        pool, ps = self.pool, self.pool.page_size
        shared = pool.lookup(tokens[:most])
        table.adopt(shared)
        reused = len(shared) * ps
        if reused < most:
            parent = pool.ids[shared[-1]] if shared else ROOT
            page, n = pool.lookup_tail(parent, tokens[reused:most])
            if n and page not in (keep or []):
                try:
                    table.pages.append(pool.copy_prefix(page))
                    reused += n
                except PoolExhausted:
                    pass  # no page to copy into: prefill those tokens instead
        return min(reused, most)

    def close(self, owner: object) -> None:
        """Thread-safe: the owner is gone; its running sequence ends and its pages go back at the next step."""
        self._closing.append(owner)

    def reset(self) -> None:
        """Between runs: every idle owner's pages go back and cached prefixes are forgotten (a cold start)."""
        self._reap()
        while self._evict_idle():
            pass
        self.pool.forget()
        self.first_logits.clear()

    def take(self, seq: Sequence) -> StreamResult | None:
        return self.outbox.pop(seq, None)

    def cached_ids(self, owner: object) -> list[int]:
        """The tokens whose k/v the owner holds (its running sequence's or its last turn's)."""
        for seq in self.running:
            if seq.owner is owner:
                return seq.tokens[: seq.n_cached]
        kept = self.retained.get(owner)
        return list(kept.ids) if kept is not None else []

    def pool_info(self) -> dict[str, int]:
        pool = self.pool
        return {"pages": pool.usable_pages, "page_size": pool.page_size, "used_pages": pool.used_pages,
                "page_bytes": pool.page_bytes, "running": len(self.running), "idle_sessions": len(self.retained)}

    # ------------------------------------------------------------------ pages
    def _keep_first(self, prompt: list[int], row: torch.Tensor) -> None:
        """Keep a prompt's last-row logits (least recently used dropped past first_logits_bytes)."""
        key = tuple(prompt)
        self.first_logits[key] = row.detach().clone()
        self.first_logits.move_to_end(key)
        size = row.numel() * row.element_size()
        while len(self.first_logits) * size > self.first_logits_bytes:
            self.first_logits.popitem(last=False)

    def _evict_idle(self) -> bool:
        """Release the least recently used idle owner's pages (the pool calls this when it has none free)."""
        if not self.retained:
            return False
        _, kept = self.retained.popitem(last=False)
        kept.table.release(kept.ids)
        return True

    def _reap(self) -> None:
        while self._closing:
            owner = self._closing.pop()
            for seq in self.running:
                if seq.owner is owner and not seq.done:
                    seq.end(StreamResult(), "cancelled", None)
                    seq.table.release(seq.tokens[: seq.n_cached])
                    self.outbox.pop(seq, None)
            self.running = [s for s in self.running if not s.done]
            kept = self.retained.pop(owner, None)
            if kept is not None:
                kept.table.release(kept.ids)
            self._drafters = {key: d for key, d in self._drafters.items() if key[0] != id(owner)}

    # ------------------------------------------------------------------ set-up
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
        if req.speculative not in MODES:
            raise ValueError(f"speculative must be one of {list(MODES)}, got {req.speculative!r}")
        if req.speculative == "draft" and self.draft_model is None:
            raise ValueError("speculative 'draft' needs a draft model; this generator has none")

    def _sampler(self, req: GenerationRequest) -> Sampler:
        factory = self.model.sampler_factory
        if factory is None:
            return Sampler(req.settings, self.model.args.vocab_size)
        sampler = factory(req.settings, self.model.args.vocab_size)
        if not isinstance(sampler, Sampler):
            raise TypeError(f"the model's sampler_factory gave {type(sampler).__name__}, not a Sampler")
        return sampler

    def _drafter(self, owner: object, mode: str, prompt_len: int) -> Drafter | None:
        if mode == "none":
            return None
        if mode == "self":
            return self.self_draft
        if mode == "auto":  # its own each time; a draft model's cache (per owner) comes along
            model = self._drafter(owner, "draft", prompt_len) if self.draft_model is not None else None
            assert model is None or isinstance(model, ModelDrafter)
            return SeqDrafter(self.auto, prompt_len, model)
        key = (id(owner), mode)
        if key not in self._drafters:
            if mode == "draft":
                assert self.draft_model is not None
                self._drafters[key] = ModelDrafter(self.draft_model, self.capacity)
            else:
                self._drafters[key] = NgramDrafter()
        return self._drafters[key]
