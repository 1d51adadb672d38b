"""A scored prompt (the engine's PromptTokens) in the API's two shapes (docs/api.md, "Scoring a prompt").

    vLLM's prompt_logprobs:  [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]   one entry per prompt
        token; the first has nothing before it (null); each dict holds the prompt token itself first, then its top k
        (ranks 1..k; the prompt token once where it is among them), as vLLM's LogprobsProcessor builds it.
    OpenAI's legacy echo:    logprobs {tokens, token_logprobs, top_logprobs, text_offset} with the prompt's tokens
        first: token_logprobs[0] and top_logprobs[0] are null, then the completion's tokens as usual.
logprob = ln p of the model's raw softmax (the websocket's `p`); a p that underflows to 0 is -9999.0, as OpenAI writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from webchat.engine import events as ev


def logprob(p: float | None) -> float:
    return math.log(p) if p is not None and p > 0.0 else -9999.0


def vllm_prompt_logprobs(tokens: list[ev.TokenInfo], k: int, decoded: Callable[[int], str]) -> list[Any]:
    """vLLM's `prompt_logprobs`: decoded(id) is one token's text on its own (vLLM's decoded_token)."""
    out: list[Any] = [None]
    for t in tokens[1:]:
        entry = {str(t.id): {"logprob": logprob(t.prob), "rank": t.rank, "decoded_token": decoded(t.id)}}
        for rank, (tid, _, p) in enumerate(t.top[:k], start=1):
            entry.setdefault(str(tid), {"logprob": logprob(p), "rank": rank, "decoded_token": decoded(tid)})
        out.append(entry)
    return out


def echo_logprobs(tokens: list[ev.TokenInfo], k: int) -> dict[str, list[Any]]:
    """The legacy completions logprobs of the prompt's tokens: `tokens` their pieces (the exact text each adds),
    `text_offset` in characters from 0, `top_logprobs` k alternatives by display text (the likelier of two ids with
    one text), null for the first token."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for i, t in enumerate(tokens):
        out["tokens"].append(t.piece)
        out["token_logprobs"].append(None if i == 0 else logprob(t.prob))
        top: dict[str, float] | None = None
        if i > 0:
            top = {}
            for _, text, p in t.top[:k]:
                top.setdefault(text, logprob(p))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(t.piece)
    return out
