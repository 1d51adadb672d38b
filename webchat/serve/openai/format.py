"""The OpenAI adapter of the worker's neutral events (webchat.engine.events): chat and text completions, whole or as
Server-Sent Events chunks, with per-token logprobs.

    Started → Tokens* → Finished      as     role chunk, content chunks, finish chunk[, usage chunk], [DONE]

logprob = ln p, p the softmax of the model's raw logits (the websocket's `p`); 0 → -9999.0, as OpenAI writes -inf.
An extension, `stats` (the websocket's `done.stats`: prefill_ms, ttft_ms, decode_tps, drafted, accepted, ...), rides
on the finish chunk and the whole response, as llama.cpp's server adds `timings`.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from webchat.engine import events as ev

if TYPE_CHECKING:
    from webchat.serve.openai.tools import ToolCalls
    from webchat.text.tokenizer import Tokenizer

FINISH = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length", "context_full": "length",
          "cancelled": "stop"}
DONE = b"data: [DONE]\n\n"
LEGACY_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def logprob(p: float | None) -> float:
    return math.log(p) if p is not None and p > 0.0 else -9999.0


def sse(obj: dict[str, Any]) -> bytes:
    """One Server-Sent Event: `data: <json>` and a blank line (JSON escapes newlines, so one data line)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def merge(events: list[ev.Event]) -> list[ev.Event]:
    """Consecutive Tokens as one (texts joined, token lists concatenated): a slow reader gets fewer, larger chunks."""
    out: list[ev.Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, ev.Tokens) and isinstance(last, ev.Tokens):
            out[-1] = ev.Tokens(last.text + event.text, last.tokens + event.tokens)
        else:
            out.append(event)
    return out


@dataclass
class Reply:
    """One request's answer in OpenAI's schema; `chat` picks chat.completion(.chunk) or text_completion.

    logprobs: None = not asked for; else how many top alternatives each token carries (0..20).
    """

    chat: bool
    model: str
    tokenizer: Tokenizer | None  # None: a remote engine (token bytes and texts come from upstream)
    logprobs: int | None = None
    include_usage: bool = False
    token_ids: bool = False  # return_token_ids: each choice carries its tokens' ids (vLLM's extension)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    entries: list[dict[str, Any]] = field(default_factory=list)  # chat: logprobs.content
    legacy: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in LEGACY_KEYS})  # text completions
    ids: list[int] = field(default_factory=list)  # every token's id so far (kept with token_ids only)
    tools: ToolCalls | None = None  # the reply's tool calls, parsed as it streams (a chat request with tools)

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    # ------------------------------------------------------------ streaming
    def role_chunk(self) -> dict[str, Any] | None:
        """The first chat chunk (OpenAI's): the role, empty content."""
        return self._chunk({"role": "assistant", "content": ""}, None, None) if self.chat else None

    def chunk(self, event: ev.Tokens) -> dict[str, Any] | None:
        """A content chunk; None when it would carry nothing (no text, no logprobs asked for)."""
        if not event.text and not (self.logprobs is not None and event.tokens):
            return None
        offset = len(self.text)
        self.text += event.text
        if self.token_ids:
            self.ids += [t.id for t in event.tokens]
        if self.chat:
            entries = self._entries(event.tokens)
            self.entries += entries or []
            delta = self._delta(*self.tools.feed(event.text)) if self.tools is not None else {"content": event.text}
            if not delta and entries is None:
                return None
            chunk = self._chunk(delta, None if entries is None else {"content": entries}, None)
        else:
            chunk = self._chunk(event.text, self._legacy(event.tokens, offset), None)
        if self.token_ids:
            chunk["choices"][0]["token_ids"] = [t.id for t in event.tokens]
        return chunk

    def finish_chunks(self, event: ev.Finished) -> list[dict[str, Any]]:
        """The finish_reason chunk (with webchat's `stats`), then with include_usage the usage chunk (no choices)."""
        out = []
        if self.tools is not None and (delta := self._delta(*self.tools.finish())):
            out.append(self._chunk(delta, None, None))
        out.append({**self._chunk({} if self.chat else "", None, self._finish(event)), "stats": asdict(event.stats)})
        if self.include_usage:
            out.append({**self._head(chunk=True), "choices": [], "usage": usage(event.stats)})
        return out

    def _chunk(self, delta: dict[str, Any] | str, logprobs: dict[str, Any] | None,
               finish: str | None) -> dict[str, Any]:  # fmt: skip
        choice: dict[str, Any] = {"index": 0}
        choice.update({"delta": delta} if self.chat else {"text": delta})
        choice.update(logprobs=logprobs, finish_reason=finish)
        obj = {**self._head(chunk=True), "choices": [choice]}
        if self.include_usage:
            obj["usage"] = None
        return obj

    # ------------------------------------------------------------ whole
    def add(self, event: ev.Tokens) -> None:
        self.chunk(event)

    def response(self, event: ev.Finished) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat and self.tools is not None:
            self.tools.finish()
            calls = self.tools.calls
            choice["message"] = {"role": "assistant", "content": self.tools.content if not calls
                                 or self.tools.content.strip() else None, **({"tool_calls": calls} if calls else {})}
            choice["logprobs"] = None if self.logprobs is None else {"content": self.entries}
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
            choice["logprobs"] = None if self.logprobs is None else {"content": self.entries}
        else:
            choice["text"] = self.text
            choice["logprobs"] = None if self.logprobs is None else self.legacy
        if self.token_ids:
            choice["token_ids"] = self.ids
        choice["finish_reason"] = self._finish(event)
        return {**self._head(chunk=False), "choices": [choice], "usage": usage(event.stats),
                "stats": asdict(event.stats)}

    # ------------------------------------------------------------ pieces
    def _finish(self, event: ev.Finished) -> str:
        """finish_reason: "tool_calls" when the reply made calls and ended by itself; a cut reply is "length"."""
        reason = FINISH[event.reason]
        return "tool_calls" if reason == "stop" and self.tools is not None and self.tools.calls else reason

    @staticmethod
    def _delta(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {**({"content": content} if content else {}), **({"tool_calls": calls} if calls else {})}

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _entries(self, tokens: list[ev.TokenInfo]) -> list[dict[str, Any]] | None:
        """Chat logprobs.content: token = the exact text it adds (the tokens' texts concatenate to the content),
        bytes = the token's own bytes, top_logprobs = the most likely tokens by their vocabulary text; `id` on each
        entry and alternative is the token's id (llama.cpp's server adds the same field)."""
        if self.logprobs is None:
            return None
        tok = self.tokenizer  # None on a remote engine: a token's bytes are its text's

        def raw(tid: int, text: str) -> list[int]:
            return list(tok.token_bytes(tid) if tok is not None else text.encode())

        def entry(tid: int, text: str, p: float | None) -> dict[str, Any]:
            out = {"id": tid} if tid >= 0 else {}  # a remote engine may not have given it
            return {**out, "token": text, "logprob": logprob(p), "bytes": raw(tid, text)}

        return [{**entry(t.id, t.piece, t.prob), "top_logprobs": [entry(tid, text, p) for tid, text, p in t.top]}
                for t in tokens]

    def _legacy(self, tokens: list[ev.TokenInfo], offset: int) -> dict[str, Any] | None:
        """Text-completion logprobs (the legacy shape): parallel lists; text_offset in characters of the text."""
        if self.logprobs is None:
            return None
        part: dict[str, list[Any]] = {k: [] for k in LEGACY_KEYS}
        for t in tokens:
            part["tokens"].append(t.piece)
            part["token_logprobs"].append(logprob(t.prob))
            top: dict[str, float] = {}
            for _, text, p in t.top:
                top.setdefault(text, logprob(p))  # two ids with one display text: the likelier one
            part["top_logprobs"].append(top)
            part["text_offset"].append(offset)
            offset += len(t.piece)
        for key, values in part.items():
            self.legacy[key] += values
        return part


def usage(stats: ev.Stats) -> dict[str, int]:
    """Token counts; completion_tokens counts every sampled token, the end-of-turn token included."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def error_chunk(status: int, message: str, code: str) -> bytes:
    """A failure after the stream began (the status line is already sent): an error event; [DONE] follows."""
    from webchat.serve.openai.schema import APIError

    return sse(APIError(status, message, code).body())
