"""Thinking on the OpenAI API: a reply's thinking apart from its content, under the names clients read.

    delta / message: {"content": answer, "reasoning_content": thinking, "reasoning": thinking}
    logprobs:        {"content": [answer tokens], "reasoning_content": [thinking tokens]}

`reasoning_content` is llama-server's and DeepSeek's name (the openai client keeps it in `model_extra`; LiteLLM,
LangChain and the Vercel AI SDK read it); `reasoning` is vLLM's since its rename (vllm-project/vllm#27752) and
OpenRouter's, which clients written for those read (llama_index, llama-swap, Cline): both carry the same text.
`reasoning_format: "none"` (llama-server's) keeps the reply as the model wrote it, markers and all, in `content`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from webchat.engine import events as ev

NAMES = ("reasoning_content", "reasoning")
FORMATS = ("auto", "deepseek", "none")  # llama-server's reasoning_format values webchat takes


@dataclass
class Parts:
    """One event's text and tokens by part (tokens only where the request carries them)."""

    thinking: str
    answer: str
    thinking_tokens: list[ev.TokenInfo]
    answer_tokens: list[ev.TokenInfo]


def parts(event: ev.Tokens, raw: bool) -> Parts:
    """raw: everything is content, each token with the text the model wrote (its markers included)."""
    if raw:
        tokens = [t if t.raw is None else dataclasses.replace(t, piece=t.raw) for t in event.tokens]
        return Parts("", "".join(t.piece for t in tokens) if tokens else event.text, [], tokens)
    return Parts(event.thinking, event.answer, [t for t in event.tokens if t.part == "thinking"],
                 [t for t in event.tokens if t.part != "thinking"])


def fields(thinking: str) -> dict[str, str]:
    """The thinking under both names (none when there is none)."""
    return {name: thinking for name in NAMES} if thinking else {}


def delta(p: Parts) -> dict[str, Any]:
    """A stream chunk's delta: the thinking's names, and `content` when the chunk has answer text or no thinking."""
    out: dict[str, Any] = fields(p.thinking)
    if p.answer or not p.thinking:
        out["content"] = p.answer
    return out


def logprobs(content: list[dict[str, Any]] | None, thinking: list[dict[str, Any]]) -> dict[str, Any] | None:
    """logprobs with the thinking tokens' entries beside the content's (`reasoning_content`, where there are any)."""
    if content is None:
        return None
    return {"content": content, **({"reasoning_content": thinking} if thinking else {})}
