"""Chat prompts whose message content stays text, and a chat-template sandbox with a time and an output budget.

    render(messages) = t0 + c[k0] + t1 + c[k1] + ... + tn      t: the template's own text, c: one message's content

`chat_parts` finds that split by rendering once with each content replaced by a unique placeholder and checking it
against the real rendering; the tokenizer then parses special tokens (`<|im_start|>`) in the t parts only, so a user
who types a control marker gets its text, never its control id.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TIME_BUDGET_S = 5.0  # one render; real templates take milliseconds
OUTPUT_BUDGET = 8 << 20  # characters of one render (and of any string or list built by `*`)
MAX_EXPONENT = 256  # `a ** b` in a template: |b| at most this

Part = tuple[str, bool]  # (text, is_content)


class TemplateBudgetError(jinja2.TemplateError):
    """A chat template ran past its time budget or built more output than its output budget."""


class _Budget(threading.local):
    deadline: float = float("inf")
    time_s: float = TIME_BUDGET_S
    output: int = OUTPUT_BUDGET


_BUDGET = _Budget()


def _check_time() -> None:
    if time.monotonic() > _BUDGET.deadline:
        raise TemplateBudgetError(f"the chat template ran past its time budget of {_BUDGET.time_s:g} s")


def _check_size(n: int, what: str) -> None:
    if n > _BUDGET.output:
        raise TemplateBudgetError(f"the chat template built {what} of {n} characters; its output budget is "
                                  f"{_BUDGET.output} characters")


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, checking the time budget at every call, attribute and `*`/`**`, and sizes at `*`."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise TemplateBudgetError(f"the chat template computed x ** {right}; allowed exponents are at most "
                                      f"{MAX_EXPONENT}")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(count, int):
                    _check_size(len(seq) * count, "a repeated sequence")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_time()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_time()
        return super().getitem(obj, argument)


@contextmanager
def budget(time_s: float | None = None, output: int | None = None) -> Iterator[None]:
    """Run the renders inside under a time budget (from now) and an output budget, on this thread."""
    saved = (_BUDGET.deadline, _BUDGET.time_s, _BUDGET.output)
    _BUDGET.time_s = TIME_BUDGET_S if time_s is None else time_s
    _BUDGET.output = OUTPUT_BUDGET if output is None else output
    _BUDGET.deadline = time.monotonic() + _BUDGET.time_s
    try:
        yield
    finally:
        _BUDGET.deadline, _BUDGET.time_s, _BUDGET.output = saved


def render_budgeted(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """Render piece by piece, stopping as soon as the output or the time passes its budget (one opened if none is)."""
    if _BUDGET.deadline == float("inf"):
        with budget():
            return _render(template, variables)
    return _render(template, variables)


def _render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    pieces: list[str] = []
    size = 0
    for piece in template.generate(**variables):
        size += len(piece)
        _check_size(size, "a prompt")
        _check_time()
        pieces.append(piece)
    return "".join(pieces)


# ---------------------------------------------------------------- content kept apart from the template's text
class ContentRewritten(ValueError):
    """The template changed a message's content in a way that cannot be told apart from its own text."""


def chat_parts(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]],
               continue_final: bool = False) -> list[Part]:  # fmt: skip
    """The rendered prompt as (text, is_content) parts that concatenate to `render(messages)`.

    continue_final: the prompt ends right after the final message's content (its end-of-turn left out), so the
    model continues that message; render without the generation prompt then.
    """
    nonce = secrets.token_hex(8)
    last = len(messages) - 1
    marked: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content, reasoning = m.get("content"), m.get("reasoning_content")
        keep = isinstance(content, str) and (content != "" or (continue_final and i == last))
        mark = {"content": f"\ue000{nonce}:{i}c\ue001"} if keep else {}
        if isinstance(reasoning, str) and reasoning != "":  # an assistant's thinking is content too
            mark["reasoning_content"] = f"\ue000{nonce}:{i}r\ue001"
        marked.append({**m, **mark})
    with budget():
        skeleton = render(marked)
        full = render(messages)
    # [t0, i0, f0, t1, i1, f1, ..., tn]: message index i, field f (c: content, r: reasoning_content)
    pieces = re.split(f"\ue000{nonce}:(\\d+)([cr])\ue001", skeleton)
    if len(pieces) == 1:
        if full != skeleton:
            raise ContentRewritten("the chat template renders differently around message contents")
        return [(full, False)] if full else []
    if continue_final:
        final = [j for j in range(1, len(pieces), 3) if int(pieces[j]) == last and pieces[j + 1] == "c"]
        if not final:
            raise ContentRewritten(f"the chat template does not show the final message (index {last}); "
                                   "it cannot be continued")
        pieces = pieces[: final[-1] + 2] + [""]
    parts: list[Part] = [(pieces[0], False)]
    pos = len(pieces[0])
    if not full.startswith(pieces[0]):
        raise ContentRewritten("the chat template renders differently around message contents")
    for j in range(1, len(pieces), 3):
        index, after = int(pieces[j]), pieces[j + 2]
        content = str(messages[index]["content" if pieces[j + 1] == "c" else "reasoning_content"])
        ends = j + 3 == len(pieces)
        for cand in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip(), content.strip("\n"),
                                   content.lstrip("\n"))):
            nxt = pos + len(cand)
            if full.startswith(cand, pos) and full.startswith(after, nxt) and (continue_final or not ends
                                                                                or nxt + len(after) == len(full)):
                break
        else:
            role = messages[index].get("role")
            raise ContentRewritten(f"the chat template rewrites the content of message {index} (role {role!r}); "
                                   "webchat cannot keep it apart from the template's own markers")
        parts += [(cand, True), (after, False)]
        pos = nxt + len(after)
    return [(text, is_content) for text, is_content in parts if text]
