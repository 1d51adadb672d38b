"""An upstream's thinking as parts on the tokens it sends: the same fold as a local reply's.

    delta {"reasoning_content" | "reasoning": text, "content": text}, logprobs.content[] (all the chunk's tokens)
        → the first tokens, as long as `text` of thinking, are "thinking"; the rest "answer"     (vLLM, llama-server)
    logprobs {"reasoning_content": [...], "content": [...]}    → by list                       (webchat)
A token that is only a marker (`<think>`, vLLM and llama-server send it in logprobs though not in the text) keeps
its text as `raw` and shows nothing, as do whitespace tokens just after a marker, as webchat.text.thinking_split does.
Where the upstream sends no logprobs, the thinking and the answer come as a token each, with nothing known of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from webchat.engine import events as ev
from webchat.text.thinking import KNOWN_MARKERS, opens
from webchat.text.thinking_split import Markers, Part, PartSplitter

if TYPE_CHECKING:
    from webchat.serve.thinking import Ask

MARKERS = frozenset(m for pair in KNOWN_MARKERS for m in pair)
STARTS = frozenset(start for start, _ in KNOWN_MARKERS)
NO_ID = -1


def thinking_text(delta: Any) -> str:
    """A chat delta's thinking: llama-server's / DeepSeek's `reasoning_content`, else vLLM's `reasoning`."""
    if not isinstance(delta, dict):
        return ""
    for name in ("reasoning_content", "reasoning"):
        text = delta.get(name)
        if isinstance(text, str) and text:
            return text
    return ""


class ThinkingLabels:
    """One stream's labelling: markers seen (past one, whitespace leaves the text) and thinking met."""

    def __init__(self) -> None:
        self.seen = False  # this stream has sent thinking: markers in its tokens are markers, not text
        self.started = False
        self.after_marker = False

    def label(self, tokens: list[ev.TokenInfo], n_thought: int, thinking: str, content: str) -> None:
        """Label one chunk's tokens: the first n_thought (webchat's list), else those the delta's thinking covers
        (a reply's opening start marker is thinking where the content does not show it: vLLM sends its token in a
        chunk with no text; an upstream that parses nothing sends it as content, and it stays text)."""
        first = tokens[0].piece.strip() if tokens else ""
        opening = not self.started and first in STARTS and first not in content
        self.started = self.started or bool(tokens)
        self.seen = self.seen or bool(thinking) or n_thought > 0 or opening
        if not self.seen:
            return
        if opening and not thinking and n_thought == 0:
            n_thought = 1
        covered = 0
        for i, tok in enumerate(tokens):
            if i < n_thought or (n_thought == 0 and covered < len(thinking)):
                tok.part = "thinking"
            covered += len(tok.piece) if tok.piece.strip() not in MARKERS else 0
            self._show(tok)

    def _show(self, tok: ev.TokenInfo) -> None:
        """A marker, and whitespace right after one, leave the text (kept as `raw`)."""
        if tok.piece.strip() in MARKERS and tok.piece.strip():
            tok.raw, tok.piece, self.after_marker = tok.piece, "", True
        elif self.after_marker:
            shown = tok.piece.lstrip()
            if shown != tok.piece:
                tok.raw, tok.piece = tok.piece, shown
            self.after_marker = shown == ""

    def text_tokens(self, thinking: str, answer: str) -> list[ev.TokenInfo]:
        self.seen = True
        out = [ev.TokenInfo(id=NO_ID, piece=thinking, part="thinking")]
        return out + ([ev.TokenInfo(id=NO_ID, piece=answer)] if answer else [])


class TextSplit:
    """A continuation the upstream sends as plain text (a branch given as token ids, continued by /v1/completions)
    from inside thinking: split here as the local engine splits it (webchat.text.thinking_split)."""

    def __init__(self, markers: Markers, inside: bool) -> None:
        self.splitter: PartSplitter[ev.TokenInfo] = PartSplitter(markers, inside)

    def push(self, tokens: list[ev.TokenInfo]) -> list[ev.TokenInfo]:
        return self._labelled([o for t in tokens for o in self.splitter.push(t, t.piece)])

    def flush(self) -> list[ev.TokenInfo]:
        return self._labelled(self.splitter.flush())

    @staticmethod
    def _labelled(items: list[tuple[ev.TokenInfo, str, Part]]) -> list[ev.TokenInfo]:
        for tok, shown, part in items:
            if shown != tok.piece:
                tok.raw, tok.piece = tok.piece, shown
            tok.part = part
        return [tok for tok, _, _ in items]


def text_split(job_messages: list[dict[str, Any]] | None, by_ids: bool) -> TextSplit | None:
    """The split for a branch continued from inside thinking (its final message opens it), else None."""
    markers = Markers()
    final = str((job_messages or [{}])[-1].get("content") or "")
    return TextSplit(markers, inside=True) if by_ids and opens(final, markers) else None


# each engine's name for a request's reasoning budget: llama-server's, vLLM's (SGLang has none per request)
BUDGET_FIELDS = {"llama.cpp": "reasoning_budget_tokens", "webchat": "reasoning_budget_tokens",
                 "vllm": "thinking_token_budget"}


def thinking_fields(kind: str, ask: Ask | None) -> dict[str, Any]:
    """What a job asks of thinking, in the upstream's fields: chat_template_kwargs (vLLM, SGLang, llama-server,
    webchat), the budget where the engine takes one; nothing for an engine that is only OpenAI-compatible."""
    if ask is None or kind == "openai-compatible":
        return {}
    out: dict[str, Any] = {"chat_template_kwargs": ask.kwargs} if ask.kwargs else {}
    if ask.budget is not None and kind in BUDGET_FIELDS:
        out[BUDGET_FIELDS[kind]] = ask.budget
        if ask.message and kind != "vllm":
            out["reasoning_budget_message"] = ask.message
    return out
