"""Who runs, and on which pages (vLLM's scheduler and block manager in one): admission, a prompt's cached prefix,
pages grown for every row of a step with the newest sequence preempted when the pool runs out, a finished turn's
pages kept for its owner's next turn, and owners gone.

    scheduler.fits(request) -> bool                    # its prompt's pages fit beside the running ones now
    table, reused, first = scheduler.admit(owner, prompt, scoring)   # the longest cached prefix, to the token
    kept = scheduler.reserve(seqs_and_feeds)           # pages for a step's rows; preempts the newest when out
    scheduler.retire(seq)                              # a finished sequence: its pages stay with its owner
    scheduler.close(owner) (any thread); scheduler.reap() -> owners gone; scheduler.reset()

A finished turn's pages stay with its owner (Retained) for the next turn's prefix until the pool needs them (least
recently used first, `evict_idle`, which the pool calls); any other owner's registered pages serve a prompt that
shares them, to the token (`reuse`); a prompt's last-row logits are kept beside its pages (`keep_first`), so the same
prompt again samples its first token with no forward.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from webchat.engine.sequence import Sequence, StreamResult
from webchat.engine.spec.drafters import common_prefix
from webchat.model.kv_cache import ROOT, KVPool, PageTable, PoolExhausted

FIRST_LOGITS_BYTES = 16 << 20  # kept last-row logits of recent prompts: 85 rows of a 49152 vocab


@dataclass
class Retained:
    """A finished turn's pages, kept for its owner's next turn: k/v of ids[i] at position i."""

    table: PageTable
    ids: list[int]


class Scheduler:
    """The running sequences, the pool's pages and the owners' kept turns: the one owner of who fits."""

    def __init__(self, pool: KVPool, capacity: int) -> None:
        self.pool, self.capacity = pool, capacity  # capacity: positions one sequence may reach
        self.pool.evict = self.evict_idle
        self.running: list[Sequence] = []
        self.retained: OrderedDict[object, Retained] = OrderedDict()  # owner -> its last turn, oldest first
        # a prompt's last-row logits, kept with its cached pages: the same prompt again (a regenerate, a retry) samples
        # its first token from them with no forward, when the pool still holds all of its k/v
        self.first_logits: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self.first_logits_bytes = FIRST_LOGITS_BYTES
        self._closing: list[object] = []  # owners gone (appended from any thread, handled on the engine's)
        self.preemptions = 0

    # ------------------------------------------------------------------ admission
    def fits(self, prompt_tokens: int) -> bool:
        """Whether a new prompt fits beside the running sequences' pages now, with a page each to grow into (vLLM's
        allocate_slots): the one place admission is decided. Pages grow on demand as sequences generate; when the
        pool runs out mid-step the newest sequence is preempted and recomputed later (`reserve`)."""
        if not self.running:
            return True
        ps = self.pool.page_size  # each running sequence: the pages it holds, or will for its tokens so far
        held = sum(max(len(s.table.pages), -(-(len(s.tokens) + 1) // ps)) for s in self.running)
        need = -(-(min(prompt_tokens, self.capacity) + 1) // ps)
        return held + need + len(self.running) <= self.pool.usable_pages

    def admit(self, owner: object, prompt: list[int], scoring: bool) -> tuple[PageTable, int, torch.Tensor | None]:
        """A new sequence's page table holding the longest cached prefix of its prompt (the owner's last turn, or any
        pages the pool still holds for it, to the token), how many tokens that is, and the prompt's kept last-row
        logits where the whole prompt is cached. `scoring`: every prompt row's logits are wanted, nothing is reused."""
        for seq in self.running:
            if seq.owner is owner:
                raise RuntimeError("this handle already has a sequence running")
        kept = self.retained.pop(owner, None)
        first = None if scoring else self.first_logits.get(tuple(prompt))
        most = 0 if scoring else len(prompt) if first is not None else len(prompt) - 1  # logits kept: the whole prompt
        own = min(common_prefix(kept.ids, prompt), most) if kept is not None else 0
        table = PageTable(self.pool)
        reused = self.reuse(table, prompt, most, keep=kept.table.pages if kept is not None else [])
        if kept is not None and own >= reused:
            table.release()
            table, reused = kept.table, own
        elif kept is not None:
            kept.table.release(kept.ids)
        table.truncate(reused)
        if first is not None:
            self.first_logits.move_to_end(tuple(prompt))
        return table, reused, first if reused == len(prompt) else None

    def reuse(self, table: PageTable, tokens: list[int], most: int, keep: list[int] | None = None) -> int:
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

    # ------------------------------------------------------------------ a step's pages
    def reserve(self, rows: Seq[tuple[Sequence, int]]) -> list[int]:
        """Pages for each (sequence, tokens it feeds) of a step, oldest sequence first; when the pool runs out, the
        newest sequence is preempted (vLLM's recompute preemption): its pages go back (its last page registered for
        reuse) and it is fed again from its prefix at a later step; the client sees a pause, never a different token.
        Returns the indices of the rows that keep their place, in the order given."""
        order = {seq: i for i, seq in enumerate(self.running)}
        kept: list[int] = []
        preempted: set[Sequence] = set()
        for i in sorted(range(len(rows)), key=lambda i: order[rows[i][0]]):
            seq, feed = rows[i]
            while seq not in preempted:
                try:
                    seq.table.ensure(seq.n_cached + feed)
                    kept.append(i)
                    break
                except PoolExhausted:
                    mine = {rows[k][0] for k in kept}
                    victim = next((s for s in reversed(self.running)
                                   if s not in mine and s not in preempted and s.table.pages), None)
                    if victim is None:
                        raise
                    self.preempt(victim)
                    preempted.add(victim)
        return sorted(kept)

    def preempt(self, seq: Sequence) -> None:
        seq.table.release(seq.cache_ids[: seq.n_cached])
        seq.n_cached = 0
        self.preemptions += 1

    def pages_free(self, need: int) -> bool:
        return need <= len(self.pool.free)

    # ------------------------------------------------------------------ turns and owners
    def retire(self, seq: Sequence) -> None:
        """A finished sequence: its pages stay with its owner for the next turn (the most recently used)."""
        self.retained[seq.owner] = Retained(seq.table, seq.cache_ids[: seq.n_cached])
        self.retained.move_to_end(seq.owner)

    def keep_first(self, prompt: list[int], row: torch.Tensor) -> None:
        """Keep a prompt's last-row logits (least recently used dropped past first_logits_bytes)."""
        key = tuple(prompt)
        self.first_logits[key] = row.detach().clone()
        self.first_logits.move_to_end(key)
        size = row.numel() * row.element_size()
        while len(self.first_logits) * size > self.first_logits_bytes:
            self.first_logits.popitem(last=False)

    def evict_idle(self) -> bool:
        """Release the least recently used idle owner's pages (the pool calls this when it has none free)."""
        if not self.retained:
            return False
        _, kept = self.retained.popitem(last=False)
        kept.table.release(kept.ids)
        return True

    def close(self, owner: object) -> None:
        """Thread-safe: the owner is gone; its running sequence ends and its pages go back at the next step."""
        self._closing.append(owner)

    def reap(self) -> tuple[list[object], list[Sequence]]:
        """The owners gone since the last call, and their running sequences, ended (cancelled) with their pages
        released."""
        gone: list[object] = []
        ended: list[Sequence] = []
        while self._closing:
            owner = self._closing.pop()
            gone.append(owner)
            for seq in self.running:
                if seq.owner is owner and not seq.done:
                    seq.end(StreamResult(), "cancelled", None)
                    seq.table.release(seq.cache_ids[: seq.n_cached])
                    ended.append(seq)
            self.running = [s for s in self.running if not s.done]
            kept = self.retained.pop(owner, None)
            if kept is not None:
                kept.table.release(kept.ids)
        return gone, ended

    def reset(self) -> None:
        """Between runs: every idle owner's pages go back and cached prefixes are forgotten (a cold start)."""
        while self.evict_idle():
            pass
        self.pool.forget()
        self.first_logits.clear()

    def cached_ids(self, owner: object) -> list[int]:
        """The tokens whose k/v the owner holds (its running sequence's or its last turn's), as the prefix cache keys
        them (an image's slots as its key id)."""
        for seq in self.running:
            if seq.owner is owner:
                return seq.cache_ids[: seq.n_cached]
        kept = self.retained.get(owner)
        return list(kept.ids) if kept is not None else []

    def pool_info(self) -> dict[str, int | str]:
        pool = self.pool
        return {"pages": pool.usable_pages, "page_size": pool.page_size, "used_pages": pool.used_pages,
                "page_bytes": pool.page_bytes, "kv_cache": pool.kind, "running": len(self.running),
                "idle_sessions": len(self.retained)}
