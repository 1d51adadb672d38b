"""A reply's tool calls, parsed as it streams, once (llama.cpp's common/chat.cpp, one parser per chat format):

    parser = ToolCallParser(fmt)             # fmt: webchat.text.toolformat.ToolFormat
    parser.feed(text) -> [Delta]             # content text, a call's start (index, id, name), argument text
    parser.finish() -> [Delta]               # what was held back (a marker that never completed is content)
    parser.spans -> [[start, end]]           # where each call is in the text fed: its markup included

Content that may be the start of the format's opening marker is held back until it is decided (as stop strings are).
A call is a JSON object {"name": ..., "arguments" | "parameters": ...}; its name is given once, its arguments as the
raw JSON text the model wrote, in pieces as they come. The deltas of a reply concatenate to the same calls however
its text is split, so a streamed reply and a whole one agree.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass

from webchat.text.toolformat import ToolFormat

WS = " \t\r\n"


@dataclass
class Delta:
    """Content text (index -1), or a piece of call `index`: its start (id and name set) or argument text."""

    content: str = ""
    index: int = -1
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def openai_id() -> str:
    return "call_" + secrets.token_hex(12)


def mistral_id() -> str:
    """Mistral's templates require ids of 9 letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class _Call:
    """One call object as it streams in: its top-level keys found by depth and string state."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.raw = ""
        self.depth, self.in_str, self.esc = 0, False, False
        self.phase = "key"  # key → colon → value → after → key ... (at depth 1)
        self.key: str | None = None
        self.key_start = self.value_start = -1
        self.name: str | None = None
        self.id: str | None = None  # given by the parser when the name is known
        self.args: str | None = None  # the whole arguments text, once its value ended
        self.done = False

    def push(self, text: str) -> int:
        """Scan text; returns how many of its characters belong to this object (all unless it ended inside)."""
        for n, ch in enumerate(text):
            i = len(self.raw)
            self.raw += ch
            self._char(ch, i)
            if self.done:
                return n + 1
        return len(text)

    def _char(self, ch: str, i: int) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 1 and self.phase == "key":
                    self.key, self.phase = _loads_str(self.raw[self.key_start : i + 1]), "colon"
                elif self.depth == 1 and self.phase == "value":
                    self._value_end(i + 1)
            return
        if ch == '"':
            self.in_str = True
            if self.depth == 1 and self.phase == "key":
                self.key_start = i
            elif self.depth == 1 and self.phase == "value" and self.value_start < 0:
                self.value_start = i
        elif ch in "{[":
            if self.depth == 1 and self.phase == "value" and self.value_start < 0:
                self.value_start = i
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.phase == "value":
                self._value_end(i + 1)
            elif self.depth == 0:
                if self.phase == "value" and self.value_start >= 0:
                    self._value_end(i)
                self.done = True
        elif self.depth == 1:
            if self.phase == "colon" and ch == ":":
                self.phase, self.value_start = "value", -1
            elif self.phase == "value" and ch == ",":
                if self.value_start >= 0:
                    self._value_end(i)
                self.phase = "key"
            elif self.phase == "value" and ch not in WS and self.value_start < 0:
                self.value_start = i  # a number, true, false or null
            elif self.phase == "after" and ch == ",":
                self.phase = "key"

    def _value_end(self, end: int) -> None:
        text = self.raw[self.value_start : end].rstrip(WS)
        if self.key == "name":
            self.name = _loads_str(text)
        elif self.key in self.args_keys:
            self.args = text
        self.phase = "after"

    def args_so_far(self) -> str:
        """The arguments text written so far (trailing whitespace held: it may lie outside the value)."""
        if self.args is not None:
            return self.args
        if self.key in self.args_keys and self.phase == "value" and self.value_start >= 0:
            return self.raw[self.value_start :].rstrip(WS) if not self.in_str else self.raw[self.value_start :]
        return ""


def _loads_str(literal: str) -> str:
    try:
        value = json.loads(literal)
    except ValueError:
        return literal.strip('"')
    return value if isinstance(value, str) else json.dumps(value)


class ToolCallParser:
    """Content and tool calls of one reply in `fmt`, from its text as it streams."""

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] | None = None) -> None:
        self.fmt = fmt
        self.new_id = new_id or (mistral_id if fmt.name == "mistral" else openai_id)
        self.pending = ""  # text not yet decided
        self.state = "start" if fmt.at_start else "text"  # start | text | free | between | call | after
        self.call: _Call | None = None
        self.calls: list[tuple[str, str]] = []  # (id, name) of every call started
        self.sent = 0  # argument characters of the current call already given
        # [start, end) of each call in the text fed: the first call of a block from its opening marker, the last to
        # its closing one (the page shows the text outside them as the reply, and each span's tokens as its call)
        self.spans: list[list[int]] = []
        self.fed = 0  # characters fed so far
        self._block_at: int | None = None  # where the current block's markup began (before its first call)
        self._start = 0  # where the current call began
        self._closes = False  # the last span may take a closing marker that follows it

    @property
    def n_calls(self) -> int:
        return len(self.calls)

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self.pending += text
        self.fed += len(text)
        while self.pending and self._step(out):
            pass
        return _merge(out)

    def finish(self) -> list[Delta]:
        """The reply ended: a call cut short keeps what it has; held text is content."""
        out: list[Delta] = []
        if self.call is not None:
            self._progress(out)
            if self.call.id is not None:
                self.spans[-1][1] = self.fed
        elif self.state in ("start", "text", "free") and (not self.calls or self._content_after_calls()):
            out.append(Delta(content=self.pending))  # (between or after calls: a block's unfinished markup)
        self.pending = ""
        return _merge(out)

    def _content_after_calls(self) -> bool:
        """Held text after the calls is content unless it is blank or an opening marker cut short."""
        text = self.pending.strip(WS)
        return bool(text) and not (self.state == "text" and self.fmt.open.startswith(text))

    # ------------------------------------------------------------ states
    def _step(self, out: list[Delta]) -> bool:
        """Advance on self.pending; False when it must wait for more text."""
        fmt, text = self.fmt, self.pending
        if self.state == "free":
            out.append(Delta(content=text))
            self.pending = ""
            return False
        if self.state == "start":  # llama 3: a call is a JSON object (or the python tag) at the start of the reply
            body = text.lstrip(WS)
            if not body:
                return False
            if body.startswith("{"):
                self.pending, self.state = body, "between"
                self._block_at = self._at()
                return True
            if fmt.open and fmt.open.startswith(body[: len(fmt.open)]):
                if len(body) < len(fmt.open):
                    return False
                self._block_at = self._at() + len(text) - len(body)
                self.pending, self.state = body[len(fmt.open) :], "between"
                return True
            self.state = "free"
            return True
        if self.state == "text":
            if self.calls:  # whitespace between or after calls is not content
                text = self.pending = text.lstrip(WS)
                if not text:
                    return False
            at = text.find(fmt.open)
            if at >= 0:
                if at:
                    out.append(Delta(content=text[:at]))
                self._block_at, self._closes = self._at() + at, False
                self.pending, self.state = text[at + len(fmt.open) :], "between"
                return True
            keep = _held(text, fmt.open)
            if keep < len(text):
                out.append(Delta(content=text[: len(text) - keep]))
                self.pending = text[len(text) - keep :]
            return False
        if self.state == "between":  # after the marker (or a separator): whitespace and `[` until the object opens
            body = text.lstrip(WS + "[")
            if not body:
                self.pending = ""
                return False
            if not body.startswith("{"):
                self.state = "text" if not fmt.at_start else "free"
                return True
            self.pending, self.state = body, "call"
            self.call, self.sent = _Call(fmt.args_keys), 0
            self._start = self._at() if self._block_at is None else self._block_at
            self._block_at, self._closes = None, False
            return True
        if self.state == "call":
            assert self.call is not None
            used = self.call.push(text)
            self.pending = text[used:]
            self._progress(out)
            if self.call.done:
                if self.call.id is not None:
                    self.spans[-1][1], self._closes = self._at(), True
                self.call, self.state = None, "after"
                return True
            return False
        return self._after(out)

    def _at(self) -> int:
        """Where the text not yet decided begins, in the whole text fed."""
        return self.fed - len(self.pending)

    def _after(self, out: list[Delta]) -> bool:
        """Between a call's end and what follows: the format's separator, its closing marker, or content."""
        fmt, text = self.fmt, self.pending.lstrip(WS)
        if not text:
            return False
        if text[0] in fmt.separators:
            self._block_at = self.fed - len(text)  # the next call's span takes the separator
            self.pending, self.state = text[1:], "between"
            return True
        if fmt.close and text.startswith(fmt.close):
            self.pending, self.state = text[len(fmt.close) :], "text" if fmt.repeat else "free"
            if self._closes:
                self.spans[-1][1] = self._at()
            return True
        if fmt.close and fmt.close.startswith(text):
            return False  # the closing marker may be forming
        self.pending, self.state = text, "text" if fmt.repeat else "free"
        return True

    def _progress(self, out: list[Delta]) -> None:
        """The current call's start once its name is known, then its new argument text."""
        call = self.call
        assert call is not None
        if call.name is None:
            return
        if call.id is None:
            call.id = self.new_id()
            self.calls.append((call.id, call.name))
            self.spans.append([self._start, self.fed])
            out.append(Delta(index=len(self.calls) - 1, id=call.id, name=call.name))
        args = call.args_so_far()
        if len(args) > self.sent:
            out.append(Delta(index=len(self.calls) - 1, arguments=args[self.sent :]))
            self.sent = len(args)


def _held(text: str, marker: str) -> int:
    """How many trailing characters of text may begin `marker` (to be held back until decided)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _merge(deltas: list[Delta]) -> list[Delta]:
    """Adjacent content deltas, and adjacent argument deltas of one call, joined."""
    out: list[Delta] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and d.index == -1 and last.index == -1:
            last.content += d.content
        elif last is not None and d.index >= 0 and d.index == last.index and d.name is None:
            last.arguments += d.arguments
        else:
            out.append(d)
    return [d for d in out if d.content or d.index >= 0]
