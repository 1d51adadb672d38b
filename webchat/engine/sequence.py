"""One request's state inside the engine, and the request/result types the generator handle speaks.

A Sequence holds what belongs to one request (exllamav2's job): its tokens, sampler, incremental decoder, stop holder,
stats, drafter (or the auto mode's offers), page table and thinking. `tokens` = prompt + sampled tokens; the pool
holds k/v for tokens[:n_cached]; the last token is "pending" (sampled, not yet fed) once the prompt is in.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from webchat.engine.constraint import Constraint
from webchat.engine.events import Stats, TokenInfo
from webchat.engine.images import ImageInput, PromptImages
from webchat.engine.sampling import Sampler
from webchat.engine.settings import SamplingSettings
from webchat.engine.spec.drafters import Drafter
from webchat.engine.spec.offers import SeqDrafter
from webchat.engine.thinking import ThinkingState
from webchat.model.kv_cache import PageTable
from webchat.text.detok import IncrementalDecoder
from webchat.text.stops import StopHolder
from webchat.text.thinking_split import Part, Thinking


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
    speculative: str = "none"  # one of webchat.engine.spec.drafters.MODES
    draft_tokens: int = 4  # k drafted tokens verified per forward
    # what may come next (a grammar: webchat.grammar); built for this request, advanced by the engine
    constraint: Constraint | None = None
    thinking: Thinking | None = None  # split the reply into thinking and answer (and bound the thinking)
    # score the prompt: each prompt token's probability, rank and this many alternatives (max_new_tokens may be 0)
    prompt_logprobs: int | None = None
    # the prompt's images: their slots' positions, content keys and rows (webchat.engine.images)
    images: list[ImageInput] = field(default_factory=list)


@dataclass
class StartInfo:
    prompt_tokens: int
    reused_tokens: int
    seed: int = 0  # the sampler's seed (chosen at random when settings.seed is None)


@dataclass
class StreamResult:
    text: str = ""
    prompt: list[TokenInfo] | None = None  # the scored prompt (prompt_logprobs), once, when its prefill ends
    token_ids: list[int] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    eos: bool = False
    eos_reason: str | None = None  # stop_token | stop_string | max_new_tokens | context_full | cancelled | error
    eos_trigger: int | str | None = None  # the stop token id or the stop string
    stop_info: TokenInfo | None = None  # the stop token that ended it, with its scores (it adds no text)
    error: tuple[str, str] | None = None  # eos_reason "error": (code, message), e.g. a grammar that cannot go on
    stats: Stats | None = None  # at eos only

    def merge(self, later: StreamResult) -> None:
        """Append a later step's result (a handle not read for a while gets one result for several steps)."""
        self.text += later.text
        self.prompt = self.prompt if later.prompt is None else later.prompt
        self.token_ids += later.token_ids
        self.tokens += later.tokens
        if later.eos:
            self.eos, self.eos_reason, self.eos_trigger, self.stats = True, later.eos_reason, later.eos_trigger, \
                later.stats
            self.stop_info, self.error = later.stop_info, later.error


@dataclass(eq=False)
class Sequence:
    """A request in the engine; identity-hashed (the engine keys results by it)."""

    req: GenerationRequest
    sampler: Sampler
    decoder: IncrementalDecoder
    holder: StopHolder[TokenInfo]
    stop_ids: frozenset[int]
    tokens: list[int]
    table: PageTable
    stats: Stats
    drafter: Drafter | None  # speculative self / ngram / draft
    limit: int  # positions this sequence may reach (the context, or the pool if smaller)
    n_cached: int = 0
    owner: object = None  # the handle (connection) whose pages it keeps after it ends
    t_begin: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    done: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    first_logits: torch.Tensor | None = None  # the whole prompt was cached with its last row's logits: no forward
    offers: SeqDrafter | None = None  # speculative auto: this sequence's offers to the step's plan
    thinking: ThinkingState | None = None  # thinking / answer, and its budget (req.thinking)
    scored: list[TokenInfo] = field(default_factory=list)  # the prompt's tokens, scored as prefilled (prompt_logprobs)
    images: PromptImages | None = None  # the prompt's images (req.images)
    keyed_prompt: list[int] | None = None  # with images: the prompt as the prefix cache keys it (cache_ids)

    @property
    def cache_ids(self) -> list[int]:
        """tokens as the prefix cache keys their pages: an image's slots as its key id (webchat.engine.images)."""
        if self.keyed_prompt is None:
            return self.tokens
        return self.keyed_prompt + self.tokens[len(self.keyed_prompt) :]

    @property
    def constrained(self) -> bool:
        """Whether the next token is masked: forced tokens, or the request's constraint where it applies (a grammar
        is off inside thinking, as SGLang does: it shapes the answer)."""
        return bool(self.forced) or self.grammar_active

    @property
    def forced(self) -> list[int]:
        """Tokens that must come next whatever the model says (a spent thinking budget's closing)."""
        return self.thinking.forced if self.thinking is not None else []

    @property
    def grammar_active(self) -> bool:
        return self.req.constraint is not None and (self.thinking is None or not self.thinking.in_thinking)

    @property
    def prefilling(self) -> bool:
        return self.stats.new_tokens == 0

    def release(self, out: StreamResult, items: list[tuple[TokenInfo, str]]) -> None:
        """Tokens the stop holder let go: through the thinking / answer split, into the result."""
        if self.thinking is None:
            add(out, items)
        else:
            self.thinking.release(items, lambda labelled: _labelled(out, labelled))

    def end(self, out: StreamResult, reason: str, trigger: int | str | None) -> None:
        if reason != "stop_string":
            self.release(out, self.holder.flush().items)
        if self.thinking is not None:  # held text ends in the part it is in (a reply cut inside thinking: thinking)
            self.thinking.flush(lambda labelled: _labelled(out, labelled))
        self.decoder.finish()
        self.done = True
        st = self.stats
        if st.new_tokens > 1:
            st.decode_tps = (st.new_tokens - 1) / max(time.perf_counter() - self.t_first, 1e-9)
        if st.new_tokens == 0 and st.prefill_ms == 0.0:
            st.prefill_ms = (time.perf_counter() - self.t_begin) * 1000
        out.eos, out.eos_reason, out.eos_trigger, out.stats = True, reason, trigger, st


def _labelled(out: StreamResult, items: list[tuple[TokenInfo, str, Part]]) -> None:
    """Tokens the splitter released, with their part; `raw` kept only where the split changed the text."""
    for token, shown, part in items:
        token.part = part
        if token.raw == shown:
            token.raw = None
        add(out, [(token, shown)])


def add(out: StreamResult, items: list[tuple[TokenInfo, str]]) -> None:
    for info, piece in items:
        info.piece = piece
        out.text += piece
        out.token_ids.append(info.id)
        out.tokens.append(info)
