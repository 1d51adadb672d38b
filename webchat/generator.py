"""The streaming generator: one sequence, its own KV cache, text and probabilities one step at a time.

    gen.begin_stream(GenerationRequest(prompt_ids=ids, ...)) -> StartInfo
    while not (res := gen.stream()).eos: print(res.text, end="")

The prompt is prefilled in chunks, one chunk per stream() call (those calls return empty results), so a worker
can interleave streams and cancel() takes effect between chunks. A prompt sharing a prefix with the tokens already
in the cache (the next chat turn) prefills only the rest.

Speculative decoding (request.speculative = "draft" | "self" | "ngram") verifies up to `draft_tokens` drafted tokens
with the main model in one forward. A draft token is accepted only if it equals the main model's own sample at that
position, drawn from the main model's distribution with the stream's generator (exllamav2's rule): every emitted
token is the main model's sample, one uniform drawn per emitted token in order, so the output for a given seed is the
same with and without speculation (greedy: token for token). Rejected tokens are rewound from both caches.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from webchat.detok import IncrementalDecoder
from webchat.events import Stats, TokenInfo
from webchat.gpu.sampler import make_sampler
from webchat.sampling import MAX_TOP_ALTS, Choice, Sampler, SamplingSettings
from webchat.speculative import MODES, Drafter, ModelDrafter, NgramDrafter, SelfDrafter, check_vocab, common_prefix
from webchat.stops import StopHolder

PREFILL_CHUNK = 256


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    settings: SamplingSettings = field(default_factory=SamplingSettings)
    max_new_tokens: int = 256
    stop_strings: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None  # None = tokenizer.stop_token_ids
    return_probs: bool = False  # prob, sampled_prob, rank and `top_alts` alternatives per token
    top_alts: int = 5
    return_logits: bool = False
    speculative: str = "none"  # one of speculative.MODES
    draft_tokens: int = 4  # k drafted tokens verified per forward


@dataclass
class StartInfo:
    prompt_tokens: int
    reused_tokens: int
    seed: int = 0  # the sampler's seed (chosen at random when settings.seed is None)


@dataclass
class StreamResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    eos: bool = False
    eos_reason: str | None = None  # stop_token | stop_string | max_new_tokens | context_full | cancelled
    eos_trigger: int | str | None = None  # the stop token id or the stop string
    stats: Stats | None = None  # at eos only


@dataclass
class _Stream:
    """State of the stream in progress. seq = prompt + sampled tokens; the cache holds seq[:cache.length]."""

    req: GenerationRequest
    sampler: Sampler
    decoder: IncrementalDecoder
    holder: StopHolder[TokenInfo]
    stop_ids: frozenset[int]
    seq: list[int]
    stats: Stats
    drafter: Drafter | None
    t_begin: float
    t_first: float = 0.0
    done: bool = False


class Generator:
    """One sequence at a time on `model`, with its own KV cache of `max_seq_len` positions (default: the model's)."""

    def __init__(self, model: Any, tokenizer: Any, max_seq_len: int | None = None, draft_model: Any = None,
                 self_draft_layers: int | None = None, prefill_chunk: int = PREFILL_CHUNK) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cache = model.new_cache(max_seq_len)
        self.cache_ids: list[int] = []  # the tokens whose k/v are in self.cache
        self.prefill_chunk = prefill_chunk
        if draft_model is not None:
            check_vocab(model, draft_model)
        self.draft_model = draft_model
        self.self_draft_layers = self_draft_layers or max(1, model.args.n_layers // 4)
        self._drafters: dict[str, Drafter] = {}
        self._cancel = threading.Event()
        self._logits: torch.Tensor | None = None  # (vocab,) next-token row when the cache holds all of seq
        self._s: _Stream | None = None

    # ------------------------------------------------------------------ public API
    def begin_stream(self, req: GenerationRequest) -> StartInfo:
        """Check the request, rewind the cache to the prefix it shares with the prompt; prefill happens in stream()."""
        self._check(req)
        self._cancel.clear()
        prompt = list(req.prompt_ids)
        reused = min(common_prefix(self.cache_ids, prompt), len(prompt) - 1)
        self._rewind(reused)
        settings = req.settings
        sampler = make_sampler(settings, self.model.args.vocab_size, self.model.device)
        stop_ids = self.tokenizer.stop_token_ids if req.stop_token_ids is None else req.stop_token_ids
        self._s = _Stream(
            req=req, sampler=sampler, decoder=IncrementalDecoder(self.tokenizer.token_bytes),
            holder=StopHolder(req.stop_strings), stop_ids=frozenset(stop_ids), seq=prompt,
            stats=Stats(prompt_tokens=len(prompt), reused_tokens=reused), drafter=self._drafter(req.speculative),
            t_begin=time.perf_counter(),
        )
        return StartInfo(prompt_tokens=len(prompt), reused_tokens=reused, seed=sampler.seed)

    def stream(self) -> StreamResult:
        """One step: a prefill chunk (empty result), or one sampled token, or several with speculation."""
        s = self._s
        if s is None or s.done:
            raise RuntimeError("no stream in progress: call begin_stream() first")
        out = StreamResult()
        if self._cancel.is_set():
            return self._end(out, "cancelled", None)
        unfed = len(s.seq) - self.cache.length
        if s.stats.new_tokens == 0 and unfed > self.prefill_chunk:
            self._feed(s.seq[self.cache.length : self.cache.length + self.prefill_chunk])
            return out
        if s.stats.new_tokens == 0 and unfed > 0:
            self._logits = self._feed(s.seq[self.cache.length :])[-1]
            s.stats.prefill_ms = (time.perf_counter() - s.t_begin) * 1000
            unfed = 0
        if len(s.seq) >= self.cache.capacity:
            return self._end(out, "context_full", None)
        k = min(s.req.draft_tokens, s.req.max_new_tokens - s.stats.new_tokens - 1,
                self.cache.capacity - len(s.seq) - 1)
        if s.drafter is not None and unfed == 1 and k > 0:
            self._speculate(out, s, k)
        else:
            self._plain_step(out, s)
        return out

    def cancel(self) -> None:
        """Thread-safe: the stream ends at its next step (between prefill chunks too) with eos_reason "cancelled"."""
        self._cancel.set()

    async def astream(self) -> AsyncIterator[StreamResult]:
        """The steps of the stream begun with begin_stream(), each run in a worker thread."""
        while True:
            res = await asyncio.to_thread(self.stream)
            yield res
            if res.eos:
                return

    # ------------------------------------------------------------------ steps
    def _plain_step(self, out: StreamResult, s: _Stream) -> None:
        if self.cache.length < len(s.seq):
            self._logits = self._feed(s.seq[self.cache.length :])[-1]
        assert self._logits is not None
        self._emit(out, s, self._sample(s, self._logits))

    def _speculate(self, out: StreamResult, s: _Stream, k: int) -> None:
        """Draft up to k tokens, score [pending, d1..dk] in one forward, keep drafts equal to the main samples."""
        assert s.drafter is not None
        drafts = s.drafter.draft(s.seq, k)[:k]
        if not drafts:
            self._plain_step(out, s)
            return
        base = self.cache.length  # seq[:base] in the cache; seq[base] is the pending token
        rows = self._feed([s.seq[base], *drafts], last_only=False)  # (1 + len(drafts), vocab)
        s.stats.drafted += len(drafts)
        accepted = 0
        for i in range(len(drafts) + 1):
            choice = self._sample(s, rows[i])
            self._emit(out, s, choice)
            if s.done or i == len(drafts) or choice.token != drafts[i]:
                break
            accepted += 1
        s.stats.accepted += accepted
        self._rewind(base + 1 + accepted)  # keep pending + accepted drafts; the last sample is the new pending token
        self._logits = None

    def _sample(self, s: _Stream, logits: torch.Tensor) -> Choice:
        req = s.req
        return s.sampler.sample(logits, s.seq, top_alts=req.top_alts if req.return_probs else 0,
                                want_probs=req.return_probs, want_logits=req.return_logits)

    def _emit(self, out: StreamResult, s: _Stream, c: Choice) -> None:
        """Append the sampled token to the sequence and the result; end the stream when a stop condition holds."""
        s.seq.append(c.token)
        s.stats.new_tokens += 1
        if s.stats.new_tokens == 1:
            s.t_first = time.perf_counter()
            s.stats.ttft_ms = (s.t_first - s.t_begin) * 1000
        if c.token in s.stop_ids:
            self._end(out, "stop_token", c.token)
            return
        info = TokenInfo(id=c.token, piece="", prob=c.prob, sampled_prob=c.sampled_prob, rank=c.rank,
                         top=[(t, self.tokenizer.id_to_text(t), p) for t, p in c.top], logits=c.logits)
        released = s.holder.push(info, s.decoder.push(c.token))
        _add(out, released.items)
        if released.stop is not None:
            self._end(out, "stop_string", released.stop)
        elif s.stats.new_tokens >= s.req.max_new_tokens:
            self._end(out, "max_new_tokens", None)

    def _end(self, out: StreamResult, reason: str, trigger: int | str | None) -> StreamResult:
        s = self._s
        assert s is not None
        if reason != "stop_string":
            _add(out, s.holder.flush().items)
        s.decoder.finish()
        s.done = True
        st = s.stats
        if st.new_tokens > 1:
            st.decode_tps = (st.new_tokens - 1) / max(time.perf_counter() - s.t_first, 1e-9)
        if st.new_tokens == 0 and st.prefill_ms == 0.0:
            st.prefill_ms = (time.perf_counter() - s.t_begin) * 1000
        out.eos, out.eos_reason, out.eos_trigger, out.stats = True, reason, trigger, st
        return out

    # ------------------------------------------------------------------ cache
    def _feed(self, ids: list[int], last_only: bool = True) -> torch.Tensor:
        """Run the main model on ids at positions cache.length..; returns logits (T or 1, vocab)."""
        x = torch.tensor(ids, dtype=torch.long, device=self.model.device)
        logits: torch.Tensor = self.model(x, self.cache, last_only=last_only)
        self.cache_ids.extend(ids)
        return logits

    def _rewind(self, n: int) -> None:
        if n < self.cache.length:
            self.cache.truncate(n)
            self._logits = None
        del self.cache_ids[n:]

    # ------------------------------------------------------------------ set-up
    def _check(self, req: GenerationRequest) -> None:
        vocab = self.model.args.vocab_size
        ids = req.prompt_ids
        if not ids:
            raise ValueError("prompt_ids must hold at least one token, got none")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab - 1}], got {bad!r}")
        if len(ids) > self.cache.capacity:
            raise ValueError(f"prompt is {len(ids)} tokens; the cache holds at most {self.cache.capacity}")
        if req.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {req.max_new_tokens}")
        if not 0 <= req.top_alts <= MAX_TOP_ALTS:
            raise ValueError(f"top_alts must be in [0, {MAX_TOP_ALTS}], got {req.top_alts}")
        if req.draft_tokens < 1:
            raise ValueError(f"draft_tokens must be at least 1, got {req.draft_tokens}")
        if req.speculative not in MODES:
            raise ValueError(f"speculative must be one of {list(MODES)}, got {req.speculative!r}")
        if req.speculative == "draft" and self.draft_model is None:
            raise ValueError("speculative 'draft' needs a draft model; this generator has none")

    def _drafter(self, mode: str) -> Drafter | None:
        if mode == "none":
            return None
        if mode not in self._drafters:
            if mode == "draft":
                self._drafters[mode] = ModelDrafter(self.draft_model, self.cache.capacity)
            elif mode == "self":
                self._drafters[mode] = SelfDrafter(self.model, self.self_draft_layers, self.cache)
            else:
                self._drafters[mode] = NgramDrafter()
        return self._drafters[mode]


def _add(out: StreamResult, items: list[tuple[TokenInfo, str]]) -> None:
    for info, piece in items:
        info.piece = piece
        out.text += piece
        out.token_ids.append(info.id)
        out.tokens.append(info)
