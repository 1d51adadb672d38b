"""Pure: an OpenAI-compatible chat stream's chunks (vLLM, SGLang, llama.cpp's server, webchat) → webchat's neutral
events (webchat.engine.events), one token at a time, each with its own alternatives.

What each engine sends in `choices[0].logprobs.content[]` (docs/scale-out.md cites the sources):
    {token, logprob, bytes?, id?, top_logprobs: [{token, logprob, bytes?, id?}]}        vLLM, SGLang, webchat, llama.cpp
    {token, prob, bytes?, id?, top_probs: [{token, prob, bytes?, id?}]}                  llama.cpp, post_sampling_probs
Token ids come as each entry's `id` (llama.cpp, webchat) or as the choice's `token_ids` (vLLM's `return_token_ids`).
A text completion (a branch sent as token ids) comes as `choices[0].text` with the same `logprobs.content` (llama.cpp)
or the legacy shape {tokens, token_logprobs, top_logprobs: [{text: logprob}]} (vLLM, webchat): no bytes, and an
alternative's id only where it is the sampled token.
A token's text is rebuilt from its `bytes` through one incremental UTF-8 decoder per stream, so a character split
across tokens shows whole on the token that completes it; without `bytes` the token's own string is used.
The upstream is untrusted: a token's alternatives are cut to the count asked for, and a probability outside its range
(a logprob above 0 or not finite, a prob outside [0, 1]) is a ChunkError naming the field.
Thinking (`delta.reasoning_content` / `delta.reasoning`) labels its tokens part "thinking" (webchat.serve.remote.
reasoning).
"""

from __future__ import annotations

import codecs
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from webchat.engine import events as ev
from webchat.serve.remote.thinking import ThinkingLabels, thinking_text

NO_ID = -1  # a token id the upstream did not return
MAX_ALTERNATIVES = 20  # OpenAI's top_logprobs limit: more than this is never kept
ROUNDING = 1e-4  # a logprob this far above 0 (or a prob this far above 1) is rounding, read as 0 (or 1)
LINE_END = re.compile(rb"\r\n|\r|\n")
# OpenAI finish_reason → webchat's Finished.reason; vLLM's `stop_reason` (a string: the stop string) refines "stop"
FINISH = {"stop": "stop_token", "length": "max_new_tokens", "abort": "cancelled", "eos": "stop_token",
          "tool_calls": "stop_token", "content_filter": "stop_token"}


class ChunkError(ValueError):
    """A chunk that is not what an OpenAI-compatible stream sends; the message names what was wrong."""


class ReportedError(ChunkError):
    """The stream's own error event (`data: {"error": ...}`), sent after a 200: the message is the upstream's."""


@dataclass
class Parsed:
    """What one chunk adds: text (the pieces of `tokens` joined, or the delta's content when it has no logprobs),
    its tokens, and at the end the webchat finish reason, its trigger and the usage counts."""

    text: str = ""
    tokens: list[ev.TokenInfo] = field(default_factory=list)
    reason: str | None = None
    trigger: str | None = None
    usage: dict[str, int] | None = None


def prob_of(entry: dict[str, Any], where: str) -> float | None:
    """The entry's probability: `prob` (llama.cpp post-sampling) or exp(`logprob`); None when neither is given;
    ChunkError naming the field when it is not a probability."""
    if "prob" in entry and entry["prob"] is not None:
        p = _number(entry["prob"], f"{where}.prob")
        if not -ROUNDING <= p <= 1 + ROUNDING:
            raise ChunkError(f"{where}.prob is {p!r}; a probability is between 0 and 1")
        return min(max(p, 0.0), 1.0)
    if "logprob" not in entry or entry["logprob"] is None:
        return None
    lp = _number(entry["logprob"], f"{where}.logprob")
    if lp > ROUNDING or math.isinf(lp) and lp > 0:
        raise ChunkError(f"{where}.logprob is {lp!r}; a log-probability is at most 0")
    return 0.0 if lp <= -9999.0 else math.exp(min(lp, 0.0))


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ChunkError(f"{where} is {type(value).__name__} {str(value)[:40]!r}; expected a number")
    if isinstance(value, float) and math.isnan(value):
        raise ChunkError(f"{where} is NaN; expected a number")
    return float(value)


def _bytes(entry: dict[str, Any]) -> bytes | None:
    raw = entry.get("bytes")
    if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
        return bytes(raw)
    return None


def _id(entry: dict[str, Any]) -> int:
    tid = entry.get("id")
    return tid if isinstance(tid, int) and not isinstance(tid, bool) and tid >= 0 else NO_ID


def _alt_text(entry: dict[str, Any]) -> str:
    raw = _bytes(entry)
    if raw is not None:
        return raw.decode("utf-8", errors="replace")
    token = entry.get("token")
    return token if isinstance(token, str) else ""


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two entries name one token: by id where both have one, else by bytes, else by their strings."""
    if _id(a) != NO_ID and _id(b) != NO_ID:
        return _id(a) == _id(b)
    ba, bb = _bytes(a), _bytes(b)
    if ba is not None and bb is not None:
        return ba == bb
    return a.get("token") == b.get("token")


class CallText:
    """An upstream's streamed `delta.tool_calls` as webchat's generic tool-call text (webchat.text.toolformat: a
    `<tool_call>` block per call), which the front's own parser reads back into calls: one parser for every engine."""

    def __init__(self) -> None:
        self.open = False
        self.args = False  # the open call has argument text

    def feed(self, calls: list[Any]) -> str:
        out = ""
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise ChunkError(f"expected delta.tool_calls[i].function to be an object, got {type(fn).__name__}")
            if isinstance(fn.get("name"), str) and fn["name"]:
                out += self.close() + '<tool_call>\n{"name": ' + json.dumps(fn["name"]) + ', "arguments": '
                self.open, self.args = True, False
            args = fn.get("arguments")
            if isinstance(args, str) and args and self.open:
                out += args
                self.args = True
        return out

    def close(self) -> str:
        if not self.open:
            return ""
        self.open = False
        return ("" if self.args else "{}") + "}\n</tool_call>\n"


class StreamParser:
    """One response stream's parser: feed() each decoded `data:` object in order, then end() once it closes.
    Each token keeps at most `alternatives` of its alternatives (the count the request asked for)."""

    def __init__(self, alternatives: int = MAX_ALTERNATIVES) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.tokens_seen = 0
        self._calls = CallText()
        self.alternatives = max(0, min(alternatives, MAX_ALTERNATIVES))
        self.thinking = ThinkingLabels()

    def feed(self, chunk: Any) -> Parsed:
        if not isinstance(chunk, dict):
            raise ChunkError(f"expected a JSON object per chunk, got {type(chunk).__name__}")
        if isinstance(chunk.get("error"), dict | str):  # vLLM and llama.cpp report a failure mid-stream this way
            err = chunk["error"]
            text = err.get("message", err) if isinstance(err, dict) else err
            raise ReportedError(str(text))
        out = Parsed(usage=_usage(chunk.get("usage")))
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise ChunkError(f"expected 'choices' to be a list, got {type(choices).__name__}")
        if not choices:  # the usage-only chunk (stream_options.include_usage)
            return out
        choice = choices[0]
        if not isinstance(choice, dict):
            raise ChunkError(f"expected choices[0] to be an object, got {type(choice).__name__}")
        delta = choice.get("delta") if "delta" in choice else None  # chat; else a text completion
        content = (delta.get("content") if isinstance(delta, dict) else None) if "delta" in choice \
            else choice.get("text")
        content = content if isinstance(content, str) else ""
        thinking = thinking_text(delta)
        logprobs = choice.get("logprobs")
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        entries = entries if isinstance(entries, list) else []
        thought = logprobs.get("reasoning_content") if isinstance(logprobs, dict) else None  # webchat's
        thought = thought if isinstance(thought, list) else []
        legacy = logprobs.get("tokens") if isinstance(logprobs, dict) else None
        ids = choice.get("token_ids")
        if entries or thought:
            ids = ids if isinstance(ids, list) and len(ids) == len(thought) + len(entries) else None
            for i, entry in enumerate(thought + entries):
                if not isinstance(entry, dict):
                    field, k = ("reasoning_content", i) if i < len(thought) else ("content", i - len(thought))
                    raise ChunkError(f"expected logprobs.{field}[{k}] to be an object, got {type(entry).__name__}")
                field, k = ("reasoning_content", i) if i < len(thought) else ("content", i - len(thought))
                out.tokens.append(self._token(entry, ids[i] if ids is not None else None,
                                              f"choices[0].logprobs.{field}[{k}]"))
            self.thinking.label(out.tokens, len(thought), thinking, content)
            out.text = "".join(t.piece for t in out.tokens)
        elif isinstance(legacy, list) and legacy:
            assert isinstance(logprobs, dict)
            ids = ids if isinstance(ids, list) and len(ids) == len(legacy) else None
            for i, entry in enumerate(_legacy_entries(logprobs, legacy)):
                out.tokens.append(self._token(entry, ids[i] if ids is not None else None,
                                              f"choices[0].logprobs.tokens[{i}]"))
            out.text = "".join(t.piece for t in out.tokens)
        elif thinking:  # text only: the thinking and the answer as a token each, with nothing known of them
            out.tokens = self.thinking.text_tokens(thinking, content)
            out.text = thinking + content
        else:
            out.text = content
        calls = delta.get("tool_calls") if "delta" in choice and isinstance(delta, dict) else None
        if isinstance(calls, list) and calls:  # the upstream parsed calls: as the generic format's text, no tokens
            out.text, out.tokens = content + self._calls.feed(calls), []
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            out.text += self._calls.close()
            out.reason = FINISH.get(reason, "stop_token")
            stop = choice.get("stop_reason")
            if reason == "stop" and isinstance(stop, str):
                out.reason, out.trigger = "stop_string", stop
            self._utf8.reset()  # a character cut at the very end is dropped, as webchat.text.detok does
        return out

    def _token(self, entry: dict[str, Any], choice_id: Any, where: str) -> ev.TokenInfo:
        raw = _bytes(entry)
        if raw is not None:
            piece = self._utf8.decode(raw)
        else:
            token = entry.get("token")
            if not isinstance(token, str):
                raise ChunkError(f"{where} has neither 'bytes' nor a string 'token'")
            piece = token
        tid = _id(entry)
        if tid == NO_ID and isinstance(choice_id, int) and not isinstance(choice_id, bool) and choice_id >= 0:
            tid = choice_id
        key = "top_logprobs" if "top_logprobs" in entry else "top_probs"
        alts = entry.get(key)
        # an upstream that sends 10,000 alternatives: the first 4 * MAX_ALTERNATIVES are read, the best kept
        alts = alts[:4 * MAX_ALTERNATIVES] if isinstance(alts, list) else []
        scored = [(a, p) for j, a in enumerate(alts) if isinstance(a, dict)
                  and (p := prob_of(a, f"{where}.{key}[{j}]")) is not None]
        scored.sort(key=lambda ap: -ap[1])
        rank = next((i + 1 for i, (a, _) in enumerate(scored) if _same(a, entry)), None)
        # an alternative without an id that is the token itself has the token's id (vLLM's token_ids, legacy maps)
        top = [(tid if _id(a) == NO_ID and _same(a, entry) else _id(a), _alt_text(a), p)
               for a, p in scored[:self.alternatives]]
        self.tokens_seen += 1
        return ev.TokenInfo(id=tid, piece=piece, prob=prob_of(entry, where), rank=rank, top=top)


def _legacy_entries(logprobs: dict[str, Any], tokens: list[Any]) -> list[dict[str, Any]]:
    """The text-completion shape (parallel lists; alternatives a {text: logprob} map, no ids, no bytes) as chat
    entries; an alternative whose text is the token's own gets the token's id later, by `_same`."""
    lps, tops = logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    if not isinstance(lps, list) or len(lps) != len(tokens):
        raise ChunkError("expected logprobs.token_logprobs beside logprobs.tokens, one per token")
    tops = tops if isinstance(tops, list) and len(tops) == len(tokens) else [None] * len(tokens)
    out = []
    for i, (token, lp, top) in enumerate(zip(tokens, lps, tops, strict=True)):
        if not isinstance(token, str):
            raise ChunkError(f"expected logprobs.tokens[{i}] to be a string, got {type(token).__name__}")
        pairs = list(top.items())[:4 * MAX_ALTERNATIVES] if isinstance(top, dict) else []
        alts = [{"token": k, "logprob": v} for k, v in pairs]
        out.append({"token": token, "logprob": lp, "top_logprobs": alts})
    return out


def _usage(raw: Any) -> dict[str, int] | None:
    if not isinstance(raw, dict):
        return None
    return {k: v for k, v in raw.items() if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 53}


def sse_data(line: str) -> str | None:
    """The payload of one Server-Sent Events line: `data: X` → X; comments, blank lines and other fields → None."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


class Lines:
    """An SSE body's lines (ended by CRLF, LF or CR) as they arrive; ChunkError once a line passes `limit` bytes
    without its end."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[str]:
        held_cr = self.buf.endswith(b"\r")
        self.buf += data
        if not held_cr and b"\n" not in data and b"\r" not in data:  # the line goes on: its length is checked
            self._check()
            return []
        end = len(self.buf) - (1 if self.buf.endswith(b"\r") else 0)  # a CR may be half of a CRLF
        parts = LINE_END.split(bytes(self.buf[:end]))
        self.buf = bytearray(parts[-1]) + self.buf[end:]
        self._check()
        return [p.decode("utf-8", errors="replace") for p in parts[:-1]]

    def end(self) -> list[str]:
        """The last line, if the body did not end with a line end."""
        rest, self.buf = bytes(self.buf).rstrip(b"\r"), bytearray()
        return [rest.decode("utf-8", errors="replace")] if rest else []

    def _check(self) -> None:
        if len(self.buf) > self.limit:
            raise ChunkError(f"a line is longer than {self.limit} bytes (no line end yet)")
