"""Chat prompts whose message content stays text (the template's budgets: webchat.text.template_budget).

    render(messages) = t0 + c[k0] + t1 + c[k1] + ... + tn      t: the template's own text, c: one message's content

`chat_parts` finds that split by rendering once with each content replaced by a unique placeholder and checking it
against the real rendering; the tokenizer then parses special tokens (`<|im_start|>`) in the t parts only, so a user
who types a control marker gets its text, never its control id. A content given as parts (`[{"type": "text", "text":
...}, {"type": "image"}]`) has a placeholder per text part; what the template writes for its other parts (an image's
marker) is the template's text.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any

from webchat.text.template_budget import TemplateBudgetError, budget

__all__ = ["ContentRewritten", "TemplateBudgetError", "budget", "chat_parts"]

Part = tuple[str, bool]  # (text, is_content)


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
        mark: dict[str, Any] = {"content": f"\ue000{nonce}:{i}c\ue001"} if keep else {}
        if isinstance(content, list):  # parts: each text part's text is content
            mark["content"] = [{**p, "text": f"\ue000{nonce}:{i}p{j}\ue001"} if _text_part(p) else p
                               for j, p in enumerate(content)]
        if isinstance(reasoning, str) and reasoning != "":  # an assistant's thinking is content too
            mark["reasoning_content"] = f"\ue000{nonce}:{i}r\ue001"
        marked.append({**m, **mark})
    with budget():
        skeleton = render(marked)
        full = render(messages)
    # [t0, i0, f0, t1, i1, f1, ..., tn]: message index i, field f (c: content, r: reasoning_content, pJ: text part J)
    pieces = re.split(f"\ue000{nonce}:(\\d+)(c|r|p\\d+)\ue001", skeleton)
    if len(pieces) == 1:
        if full != skeleton:
            raise ContentRewritten("the chat template renders differently around message contents")
        return [(full, False)] if full else []
    if continue_final:
        final = [j for j in range(1, len(pieces), 3) if int(pieces[j]) == last and pieces[j + 1] != "r"]
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
        content = _field(messages[index], pieces[j + 1])
        ends = j + 3 == len(pieces)
        escaped = json.dumps(content, ensure_ascii=False)[1:-1]  # written with tojson (Llama 3's tool results)
        for cand in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip(), content.strip("\n"),
                                   content.lstrip("\n"), escaped)):
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


def _text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) \
        and part["text"] != ""


def _field(message: dict[str, Any], field: str) -> str:
    """A message's content (c), its reasoning_content (r) or its text part J's text (pJ)."""
    if field == "c":
        return str(message["content"])
    if field == "r":
        return str(message["reasoning_content"])
    return str(message["content"][int(field[1:])]["text"])
