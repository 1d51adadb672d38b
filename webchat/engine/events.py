"""What the worker reports about one request: neutral events that each transport formats in its own adapter.

    Queued(position)* → Started → [PromptTokens] → Tokens* → Finished          (or Failed at any point)

The websocket adapter is `webchat.serve.protocol.event_messages`; an HTTP API formats the same events its own way, so
the transports cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from webchat.text.thinking_split import Part


@dataclass
class TokenInfo:
    """One emitted (or, for prompt logprobs, one prompt) token. piece: the exact text it adds to its part (the pieces
    of a result concatenate to its text; a reasoning marker's characters are in no piece). prob/rank/top use softmax
    of the main model's raw logits; sampled_prob the distribution actually drawn from (after the constraint's mask).
    part: the reply's thinking or its answer (text.thinking_split). forbidden: the ids in `top` that the request's
    constraint did not allow at this position (their prob is still the model's). raw: the token's own text where
    the thinking / answer split changed it (a marker, whitespace dropped after one): the raws of a reply's tokens,
    None read as the piece, concatenate to the text the model wrote."""

    id: int
    piece: str
    prob: float | None = None
    sampled_prob: float | None = None
    rank: int | None = None
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, display text, prob), prob descending
    logits: torch.Tensor | None = None  # (vocab,) raw row when return_logits
    part: Part = "answer"
    forbidden: list[int] = field(default_factory=list)
    raw: str | None = None  # the text the token wrote before the split took markers out; None: the same as piece


@dataclass
class Stats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    new_tokens: int = 0  # sampled tokens, the stop token included
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_tps: float = 0.0  # (new_tokens - 1) / time from first token to the end
    drafted: int = 0
    accepted: int = 0
    image_tokens: int = 0  # the prompt's image slots (counted in prompt_tokens too)
    encode_ms: float = 0.0  # time spent encoding its images (in prefill_ms and ttft_ms too); 0 where cached


@dataclass(frozen=True)
class Queued:
    """Waiting for a slot; position 1 is next."""

    position: int


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    reused_tokens: int
    trimmed_messages: int = 0  # oldest messages left out to fit the context (set by the transport, not the worker)


@dataclass(frozen=True)
class PromptTokens:
    """The prompt's tokens scored by the model (a request's prompt_logprobs): tokens[0] has no probability (nothing
    precedes it); tokens[i] is the prompt's token i with its probability, rank and alternatives given tokens[:i]."""

    tokens: list[TokenInfo]


@dataclass(frozen=True)
class Tokens:
    """New text and the tokens that carry it (tokens hold probabilities only when the request asked for them)."""

    text: str
    tokens: list[TokenInfo]

    @property
    def thinking(self) -> str:
        """The text of this event's thinking tokens (they come before its answer's)."""
        return "".join(t.piece for t in self.tokens if t.part == "thinking")

    @property
    def answer(self) -> str:
        """The text of its answer: all of `text` when it carries no tokens (a remote engine's text-only chunk)."""
        if not self.tokens:
            return self.text
        return "".join(t.piece for t in self.tokens if t.part == "answer")


@dataclass(frozen=True)
class Finished:
    reason: str  # stop_token | stop_string | max_new_tokens | context_full | cancelled
    trigger: str | None  # the stop token's text or the stop string
    stats: Stats
    stop: TokenInfo | None = None  # the stop token with its scores (reason stop_token; probabilities when asked)


@dataclass(frozen=True)
class Failed:
    """The request ended without a result: code is one of webchat.serve.protocol.ERROR_CODES."""

    code: str
    message: str


Event = Queued | Started | PromptTokens | Tokens | Finished | Failed
