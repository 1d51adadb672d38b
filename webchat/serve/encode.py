"""Templating and tokenizing a prompt without holding the event loop: short prompts inline under a small budget,
long ones (or a template that needs more) on two encode threads at nice +10 under the template's full budget."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from webchat.grammar.compiler import NICE, lower_priority
from webchat.text.template_budget import FULL, INLINE, Budget, InlineExhausted, budget

T = TypeVar("T")

OFFLOAD_TOKENS = 512  # a reply of more tokens than this (a scored prompt) is formatted and rendered off the loop
INLINE_TEXT_CHARS = 4096  # a prompt this short is templated and tokenized on the event loop (well under 1 ms)
ENCODE_THREADS = 2  # templating and tokenizing off the loop, at most this many at once (one per core)
# below the device thread's priority: a long template's render takes the CPU the forward leaves (the streams keep pace)
_ENCODE = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="webchat-encode", initializer=lower_priority,
                             initargs=(NICE,))


async def encode_text_work(fn: Callable[..., T], *args: object, chars: int) -> T:
    """fn(*args), a prompt's templating and tokenizing over `chars` characters of text.

    Short prompts run on the event loop, where a worker thread's two hand-offs cost more than the work (measured:
    encode_chat 1.34 ms inline, 1.84 ms through a thread; docs/api.md), under the template's INLINE budget (10k
    steps, 1M characters, 50 ms: a real template's short chat takes a few hundred steps); a template that needs more
    is run again on a worker thread and never tried on the loop again. Long prompts go to a worker thread at once.
    There each request's renders spend one FULL budget (500k steps, about a second at most), so no template holds a
    thread or a core for long; ENCODE_THREADS such threads bound the memory that runaway renders can hold at once."""
    if chars <= INLINE_TEXT_CHARS:
        try:
            with budget(INLINE):
                return fn(*args)
        except InlineExhausted:
            pass
    return await asyncio.get_running_loop().run_in_executor(_ENCODE, functools.partial(_spend, FULL, fn, *args))


def _spend(spend: Budget, fn: Callable[..., T], *args: object) -> T:
    with budget(spend):
        return fn(*args)


def text_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    """What templating and tokenizing chat messages costs, in characters: their text, the template's markers counted
    as 64 a message (many short messages are not cheap), and the tools the template writes out (as JSON)."""
    return sum(64 + len(str(m.get("content") or "")) for m in messages) + (len(json.dumps(tools)) if tools else 0)




async def offload(fn: Callable[..., T], *args: object, heavy: bool) -> T:
    """fn(*args): on an encode thread when `heavy` (formatting thousands of scored tokens takes the loop most of a
    second: 8,000 tokens with 20 alternatives each are 11 MB of JSON), else here."""
    if not heavy:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_ENCODE, functools.partial(fn, *args))
