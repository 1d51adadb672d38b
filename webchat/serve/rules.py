"""The input rules the websocket (webchat.serve.protocol, app) and the API (webchat.serve.openai) share, written once:
strict JSON, text that UTF-8 can carry, how a bad value is shown, the speculative mode a request runs in. Each wire
words a RuleError in its own error shape (docs/protocol.md, docs/api.md)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any


class RuleError(ValueError):
    """An input that breaks one of these rules; `field` is the input's name on both wires."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str | bytes) -> Any:
    """JSON as RFC 8259 has it (NaN and Infinity refused); ValueError or RecursionError on bad input."""
    return json.loads(text, parse_constant=_reject_constant)


def short_repr(value: Any) -> str:
    """A value as JSON (non-ASCII escaped, so a lone surrogate prints), cut to 60 characters."""
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def lone_surrogate(value: object) -> str | None:
    """The dotted path of the first string (a value or a key) holding a lone surrogate, which JSON's \\ud800 escapes
    can carry but UTF-8 and the tokenizer cannot ("" for a bare string); None when there is none. Iterative, so a
    deeply nested body cannot exhaust the stack."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return where
            continue
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            here = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and lone_surrogate(key) is not None:
                return here
            stack.append((child, here))
    return None


def safe_text(text: str) -> str:
    """text with lone surrogates written as \\udXXX escapes: always encodable, still recognisable."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def context_room(n_prompt: int, context: int) -> int:
    """How many new tokens the context leaves after an n_prompt-token prompt; RuleError on `prompt` when not even one
    fits. (What a request may ask beyond that is each wire's policy: the websocket ends at `context_full`, /v1
    refuses.)"""
    if n_prompt >= context:
        raise RuleError("prompt", f"prompt is {n_prompt} tokens; the context of {context} allows at most {context - 1}")
    return context - n_prompt


def speculative_mode(requested: str | None, default: str, modes: Sequence[str]) -> str:
    """The speculative mode a request runs in: its own when the server offers it, else the server's default."""
    mode = requested if requested is not None else default
    if mode not in modes:
        raise RuleError("speculative", f"speculative = {mode!r} is not available: allowed {list(modes)}")
    return mode
