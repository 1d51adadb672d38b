"""The OpenAI adapter of the worker's neutral events (webchat.engine.events): chat and text completions, whole or as
Server-Sent Events chunks, with per-token logprobs.

    Started → Tokens* → Finished      as     role chunk, content chunks, finish chunk[, usage chunk], [DONE]

logprob = ln p, p the softmax of the model's raw logits (the websocket's `p`); 0 → -9999.0, as OpenAI writes -inf.
A chat reply's thinking goes apart from its content (`reasoning_content`, serve/openai/thinking.py).
An extension, `stats` (the websocket's `done.stats`: prefill_ms, ttft_ms, decode_tps, drafted, accepted, ...), rides
on the finish chunk and the whole response, as llama.cpp's server adds `timings`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from webchat.engine import events as ev
from webchat.serve.openai import thinking as reasoning_api
from webchat.serve.openai.scoring import echo_logprobs, logprob, vllm_prompt_logprobs

if TYPE_CHECKING:
    from webchat.serve.tools import ToolCalls
    from webchat.text.tokenizer import Tokenizer

FINISH = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length", "context_full": "length",
          "cancelled": "stop"}
DONE = b"data: [DONE]\n\n"
LEGACY_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


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
    raw: bool = False  # reasoning_format "none": thinking stays in the content as written (serve/openai/thinking.py)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    thinking: str = ""  # chat: the reply's thinking so far (message.reasoning_content)
    entries: list[dict[str, Any]] = field(default_factory=list)  # chat: logprobs.content
    thinking_entries: list[dict[str, Any]] = field(default_factory=list)  # chat: logprobs.reasoning_content
    legacy: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in LEGACY_KEYS})  # text completions
    ids: list[int] = field(default_factory=list)  # every token's id so far (kept with token_ids only)
    echo: str | None = None  # completions' echo: the prompt's text, first in `text` (and in logprobs when asked)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives per prompt token (None: not asked)
    scored: list[Any] | None = None  # the prompt's scores in vLLM's shape, once the prefill is done
    tools: ToolCalls | None = None  # the reply's tool calls, parsed as it streams (a chat request with tools)

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        if self.echo is not None and self.logprobs is None:
            self.text = self.echo  # with logprobs, the echo waits for the prompt's scores (prompt())

    # ------------------------------------------------------------ streaming
    def role_chunk(self) -> dict[str, Any] | None:
        """The first chat chunk (OpenAI's): the role, empty content."""
        if self.chat:
            return self._chunk({"role": "assistant", "content": ""}, None, None)
        return self._chunk(self.text, None, None) if self.text else None  # an echo without logprobs

    def prompt(self, event: ev.PromptTokens) -> dict[str, Any] | None:
        """The scored prompt: kept for prompt_logprobs; with echo and logprobs, the prompt's text and legacy logprobs
        come first (returned as the chunk that streams them)."""
        if self.prompt_logprobs is not None:
            self.scored = vllm_prompt_logprobs(event.tokens, self.prompt_logprobs, self._decoded)
        if self.echo is None or self.logprobs is None or self.chat:
            return None
        part = echo_logprobs(event.tokens, self.logprobs)
        self.text = self.echo
        self.legacy = {key: part[key] + self.legacy[key] for key in LEGACY_KEYS}
        return self._chunk(self.echo, part, None)

    def _echo_stop(self, event: ev.Finished) -> dict[str, Any] | None:
        """With echo and logprobs, a completion ended by a stop token lists it last (no text: token ""), as vLLM's and
        OpenAI's echo do: then the entries are the prompt's tokens and every sampled one, and lm-evaluation-harness's
        `token_logprobs[ctxlen:-1]` is the continuation's."""
        if self.chat or self.echo is None or self.logprobs is None or event.stop is None:
            return None
        return self._legacy([event.stop], len(self.text))

    def _decoded(self, tid: int) -> str:
        """One token's own text (vLLM's decoded_token): its bytes as UTF-8, a partial character as U+FFFD."""
        return self.tokenizer.token_bytes(tid).decode("utf-8", "replace") if self.tokenizer is not None else ""

    def chunk(self, event: ev.Tokens) -> dict[str, Any] | None:
        """A content chunk (its thinking apart, serve/openai/thinking.py); None when it would carry nothing (no text,
        no logprobs asked for)."""
        part = reasoning_api.parts(event, self.raw or not self.chat)
        if not part.answer and not part.thinking and not ((self.logprobs is not None or self.token_ids)
                                                          and event.tokens):
            return None  # nothing to say (a marker's token is said where its logprob or id is asked for)
        offset = len(self.text)
        self.text += part.answer
        self.thinking += part.thinking
        if self.token_ids:
            self.ids += [t.id for t in event.tokens]
        if self.chat:
            entries, thinking = self._entries(part.answer_tokens), self._entries(part.thinking_tokens) or []
            self.entries += entries or []
            self.thinking_entries += thinking
            if self.tools is not None:  # the answer's calls parsed as they stream; thinking is never a call
                delta = {**reasoning_api.fields(part.thinking), **self._delta(*self.tools.feed(part.answer))}
                if not delta and entries is None:
                    return None
            else:
                delta = reasoning_api.delta(part)
            chunk = self._chunk(delta, reasoning_api.logprobs(entries, thinking), None)
        else:
            chunk = self._chunk(part.answer, self._legacy(part.answer_tokens, offset), None)
        if self.token_ids:
            chunk["choices"][0]["token_ids"] = [t.id for t in event.tokens]
        return chunk

    def finish_chunks(self, event: ev.Finished) -> list[dict[str, Any]]:
        """The finish_reason chunk (with webchat's `stats`), then with include_usage the usage chunk (no choices)."""
        out = []
        if self.tools is not None and (delta := self._delta(*self.tools.finish())):
            out.append(self._chunk(delta, None, None))
        out.append({**self._chunk({} if self.chat else "", self._echo_stop(event), self._finish(event)),
                    "stats": asdict(event.stats)})
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
        self._echo_stop(event)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            content: str | None = self.text
            calls: list[dict[str, Any]] = []
            if self.tools is not None:
                self.tools.finish()
                calls = self.tools.calls
                content = None if self.tools.required else (
                    self.tools.content if not calls or self.tools.content.strip() else None)
            choice["message"] = {"role": "assistant", "content": content, **reasoning_api.fields(self.thinking),
                                 **({"tool_calls": calls} if calls else {})}
            choice["logprobs"] = reasoning_api.logprobs(None if self.logprobs is None else self.entries,
                                                    self.thinking_entries)
        else:
            choice["text"] = self.text
            choice["logprobs"] = None if self.logprobs is None else self.legacy
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.scored
        if self.token_ids:
            choice["token_ids"] = self.ids
        choice["finish_reason"] = self._finish(event)
        out = {**self._head(chunk=False), "choices": [choice], "usage": usage(event.stats),
               "stats": asdict(event.stats)}
        if self.chat and self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.scored  # vLLM's chat response carries them beside `choices`
        return out

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
