"""The budgets a chat-template render spends (issue 42); webchat.text.template_sandbox spends them at every hook.

    steps : every for-loop item (the loop's iterable is wrapped at compile time), call, filter, test, operator,
            attribute and item lookup, and each value walked to size an output; a recursive loop's `loop(x)` too
    chars : every string or list an operation builds, counted *before* the C code that builds it runs where the size
            follows from the arguments (center, ljust/rjust/zfill, indent, format and %, *, +, ~, join, replace,
            expandtabs, tojson, wordwrap, batch, slice, str.format widths, a container shown as text), after for
            the rest (each bounded by its inputs, themselves counted)
    output: the rendered text, counted as the top level yields it and as a macro's or a block's output is joined
    time  : checked every 256 steps

Each render (or one request's renders together) runs under one `Budget`: FULL for a worker thread, INLINE (small:
a short prompt's template takes a few hundred steps) for the event loop, whose exhaustion is InlineExhausted, the
caller's cue to run the work again off the loop under FULL. A template once past INLINE is remembered and not
tried on the loop again. Without a budget open, the hooks count nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.utils import Namespace


@dataclass(frozen=True)
class Budget:
    steps: int
    chars: int  # characters (or list items) built, in all
    output: int  # characters of one rendered text
    seconds: float
    inline: bool = False


# Real templates (llama.cpp's models/templates, 71 of them, a 101-message chat with tools): at most 14k steps and
# 130k characters built; 1 to 3 µs a step here, so FULL ends a runaway within about a second
FULL = Budget(steps=500_000, chars=32 << 20, output=8 << 20, seconds=5.0)
INLINE = Budget(steps=10_000, chars=1 << 20, output=1 << 20, seconds=0.05, inline=True)


class TemplateBudgetError(jinja2.TemplateError):
    """A chat template ran past one of its budgets (steps, characters, output, time); the message names which."""


class InlineExhausted(TemplateBudgetError):
    """The event loop's small budget ran out: run the work again off the loop, under FULL."""


class _Open:
    """The budget being spent on this thread."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.steps, self.chars = budget.steps, budget.chars
        self.deadline = time.monotonic() + budget.seconds


class _Local(threading.local):
    open: _Open | None = None


_LOCAL = _Local()
HEAVY: set[str] = set()  # template sources that ran past INLINE: rendered off the event loop only


def exhausted(what: str) -> TemplateBudgetError:
    b = _LOCAL.open
    assert b is not None
    cls = InlineExhausted if b.budget.inline else TemplateBudgetError
    return cls(f"the chat template {what}")


def step(n: int = 1) -> None:
    b = _LOCAL.open
    if b is None:
        return
    b.steps -= n
    if b.steps < 0:
        raise exhausted(f"ran past its step budget of {b.budget.steps} steps (loop iterations, calls, filters)")
    if b.steps & 0xFF < n and time.monotonic() > b.deadline:
        raise exhausted(f"ran past its time budget of {b.budget.seconds:g} s")


def spend(steps: int, chars: int, what: str) -> None:
    """step(steps) and build(chars, what) in one call (the hot path: a template's `+` on two strings)."""
    b = _LOCAL.open
    if b is None:
        return
    if chars > b.chars or b.steps < steps:
        step(steps)
        build(chars, what)
    b.steps -= steps
    b.chars -= chars
    if b.steps & 0xFF < steps and time.monotonic() > b.deadline:
        raise exhausted(f"ran past its time budget of {b.budget.seconds:g} s")


def build(n: int, what: str) -> None:
    """Spend n characters (or items) on `what`, before it is built."""
    b = _LOCAL.open
    if b is None:
        return
    if n > b.chars:
        raise exhausted(f"would build {what} of {n} characters; at most {b.budget.chars} characters may be built "
                        f"in one render ({max(b.chars, 0)} left)")
    b.chars -= n


def built(value: Any) -> Any:
    """Spend what a finished operation built (its length, if it has one)."""
    if _LOCAL.open is not None and isinstance(value, str | bytes | list | tuple | dict | set):
        build(len(value), f"a {type(value).__name__}")
    return value


def check_output(n: int) -> None:
    b = _LOCAL.open
    if b is not None and n > b.budget.output:
        raise exhausted(f"built a text of {n} characters; its output budget is {b.budget.output} characters")


@contextmanager
def budget(spend: Budget = FULL) -> Iterator[None]:
    """Renders inside spend one budget, on this thread; a budget already open is kept (one request, one budget)."""
    if _LOCAL.open is not None:
        yield
        return
    _LOCAL.open = _Open(spend)
    try:
        yield
    finally:
        _LOCAL.open = None


@contextmanager
def own(spend: Budget = FULL) -> Iterator[None]:
    """A budget of its own for work that is no request's (a model's thinking probed once and cached for every
    request): a request's open budget is set aside meanwhile, neither spent nor able to end the probe early."""
    saved, _LOCAL.open = _LOCAL.open, _Open(spend)
    try:
        yield
    finally:
        _LOCAL.open = saved


def active() -> Budget | None:
    return None if _LOCAL.open is None else _LOCAL.open.budget


def chars_left() -> int:
    return _LOCAL.open.chars if _LOCAL.open is not None else 1 << 62


# ---------------------------------------------------------------- sizes of values shown as text
def text_size(value: Any, limit: int) -> int:
    """An upper bound of len(str(value)) (past `limit`: some number above it), walking containers; one step per
    value walked."""
    total, stack = 0, [value]
    while stack and total <= limit:
        x = stack.pop()
        step()
        if isinstance(x, str):
            total += len(x) + 2 if x.isprintable() else 10 * len(x) + 2  # repr escapes: \U0001f600 for one char
        elif isinstance(x, bool | float | type(None)):
            total += 24
        elif isinstance(x, int):
            total += x.bit_length() // 3 + 2
        elif isinstance(x, dict):
            total += 4 * len(x) + 2
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list | tuple | set | frozenset):
            total += 2 * len(x) + 2
            stack.extend(x)
        elif isinstance(x, Namespace):
            stack.append(getattr(x, "_Namespace__attrs", {}))
        else:
            total += 64  # an Undefined, a macro, a loop: a short repr (counted again once built)
    return total


def as_text(value: Any) -> str:
    """str(value), its size spent before it is built."""
    if isinstance(value, str):
        return value
    if _LOCAL.open is not None:
        build(text_size(value, chars_left()), f"the text of a {type(value).__name__}")
    return str(value)


# ---------------------------------------------------------------- one render
def render(template: jinja2.Template, source: str, variables: dict[str, Any]) -> str:
    """Render piece by piece under the open budget (FULL if none is), the output counted as it is produced.
    A template once past INLINE is not tried under it again; a failed render's memory is handed back to the OS."""
    if _LOCAL.open is None:
        with budget(FULL):
            return render(template, source, variables)
    b = _LOCAL.open
    if b.budget.inline and source in HEAVY:
        raise InlineExhausted("the chat template needs more than the event loop's budget")
    try:
        pieces: list[str] = []
        size = 0
        for piece in template.generate(**variables):
            size += len(piece)
            check_output(size)
            step()
            pieces.append(piece)
        return "".join(pieces)
    except InlineExhausted:
        if len(HEAVY) < 64:
            HEAVY.add(source)
        raise
    except TemplateBudgetError:
        trim_heap()
        raise
    except RecursionError:
        raise exhausted("recursed deeper than Python allows") from None
    except MemoryError:
        trim_heap()
        raise exhausted("ran out of memory") from None


_LIBC: Any = None


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise: a 1 GB render would stay in the RSS)."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        _LIBC = ctypes.CDLL(name) if name else False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)
