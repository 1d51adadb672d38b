"""A request's thinking, for both front ends: the chat encoded with its template variables and each assistant's
thinking where the template reads it, and the `Thinking` that splits (and bounds) the reply.

    ids = encode_chat(tok, messages, continue_final, prefix_ids, kwargs)
    reasoning = thinking_for(tok, messages, continue_final, Ask(kwargs, budget, message))   # None: no split

A reply is split where the model thinks: its template writes the end marker, its vocabulary holds the markers, or
the prompt leaves thinking open (a template whose generation prompt ends with `<think>`, a continued `<think>…`).
It is not where the prompt closed thinking already (Qwen3 with enable_thinking false): that reply is all answer.
A continued reply that holds thinking is the chat's generation prompt followed by its text as the model wrote it
(llama-server's assistant prefill), since a thinking template rewrites an assistant message's thinking.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from webchat.text.thinking import (
    ThinkingFormat,
    check_kwargs,
    for_template,
    generation_prompt,
    has_markers,
    opens,
    thinking_format,
)
from webchat.text.thinking_split import Thinking

if TYPE_CHECKING:
    from webchat.text.tokenizer import Tokenizer

MAX_BUDGET = 1 << 24
__all__ = ["Ask", "budget_value", "check_kwargs", "encode_chat", "encode_tail", "thinking_for", "thinks", "wire"]


@dataclass(frozen=True)
class Ask:
    """What a request asks of thinking: its chat_template_kwargs; a budget in thinking tokens (None: unbounded) and
    the text forced before the end marker when it runs out (llama-server's reasoning_budget_message); split False:
    the reply stays one text (reasoning_format "none"; a budget still counts its thinking)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    budget: int | None = None
    message: str = ""
    split: bool = True


def budget_value(value: int | None, default: int | None) -> int | None:
    """A request's budget: -1 unbounded, None the server's; ValueError outside [-1, 2^24]."""
    if value is None:
        return default
    if not -1 <= value <= MAX_BUDGET:
        raise ValueError(f"a reasoning budget must be -1 (unbounded) or 0 to {MAX_BUDGET} thinking tokens, got {value}")
    return None if value < 0 else value


def encode_tail(tok: Tokenizer, text: str) -> list[int]:
    """Text that continues a prompt, every character as text (no BOS: it is not a prompt's start)."""
    ids = tok.encode_text(text)
    if tok.add_bos_token and tok.bos_id is not None and ids[:1] == [tok.bos_id]:
        ids = ids[1:]
    return ids


def _continues_thinking(tok: Tokenizer, fmt: ThinkingFormat, final: str, kwargs: dict[str, Any]) -> bool:
    """A continued reply that holds thinking, or one the generation prompt opened thinking for."""
    return has_markers(final, fmt.markers) or opens(generation_prompt(tok, kwargs), fmt.markers)


def encode_chat(tok: Tokenizer, messages: list[dict[str, Any]], continue_final: bool = False,
                prefix_ids: list[int] | None = None, kwargs: dict[str, Any] | None = None,
                expand: Callable[[str], str] | None = None) -> list[int]:  # fmt: skip
    """The prompt ids (message contents as text, webchat.text.tokenizer.encode_chat); prefix_ids: the final
    assistant message as the model's own tokens, after the rest of the chat's generation prompt. expand: the images'
    markers written out (webchat.serve.images)."""
    kwargs = kwargs or {}
    fmt = thinking_format(tok)
    if prefix_ids is not None or continue_final:
        history = for_template(messages[:-1], fmt)
        if prefix_ids is not None:
            return tok.encode_chat(history, expand=expand, **kwargs) + list(prefix_ids)
        final = str(messages[-1].get("content") or "")
        if _continues_thinking(tok, fmt, final, kwargs):
            return tok.encode_chat(history, expand=expand, **kwargs) + encode_tail(tok, final)
        return tok.encode_chat([*history, messages[-1]], continue_final=True, expand=expand, **kwargs)
    return tok.encode_chat(for_template(messages, fmt), expand=expand, **kwargs)


def thinks(tok: Tokenizer, fmt: ThinkingFormat) -> bool:
    """The model writes thinking: its template writes the end marker or its vocabulary holds both markers."""
    return fmt.writes_markers or all(len(encode_tail(tok, m)) == 1 for m in (fmt.markers.start, fmt.markers.end))


def thinking_for(tok: Tokenizer, messages: list[dict[str, Any]], continue_final: bool, ask: Ask) -> Thinking | None:
    """How the reply is split and bounded; None where it is not split (a model that does not think, a prompt that
    closed thinking, reasoning_format none without a budget)."""
    fmt = thinking_format(tok)
    tail = generation_prompt(tok, ask.kwargs) + (str(messages[-1].get("content") or "") if continue_final else "")
    inside = opens(tail, fmt.markers)
    closed = not inside and fmt.markers.end in tail[max(0, tail.rfind(fmt.markers.start)):]
    if closed or not (inside or thinks(tok, fmt)) or (not ask.split and ask.budget is None):
        return None
    close = tuple(encode_tail(tok, ask.message + fmt.close_text)) if ask.budget is not None else ()
    return Thinking(markers=fmt.markers, inside=inside, budget=ask.budget, close=close)


def wire(tok: Tokenizer) -> dict[str, Any] | None:
    """hello.thinking: the model's markers and whether its template takes `enable_thinking`; None where it does not
    think."""
    fmt = thinking_format(tok)
    return fmt.wire() if thinks(tok, fmt) or fmt.switch else None
