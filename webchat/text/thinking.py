"""A model's thinking as its chat template and vocabulary write it: the markers, the template variables a request may
set (`enable_thinking`), whether the generation prompt opens thinking, and the text that closes it.

    fmt = thinking_format(tokenizer)          # once per tokenizer: markers, variables, close_text
    gen = generation_prompt(tokenizer, kwargs)  # render([u], True) minus render([u], False): what ends every prompt
    opens(gen + continued_text, fmt.markers)  # the reply starts inside thinking (templates ending with `<think>`)
    split_text(text, fmt.markers)             # a stored reply's text as (thinking, answer)

Markers are the known pair whose end marker the template writes (Qwen3, DeepSeek-R1, SmolLM3: `</think>`), else
the pair the vocabulary holds as single tokens, else `<think>` / `</think>` (llama.cpp and vLLM default the same way).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2

from webchat.text.template_budget import FULL, INLINE, InlineExhausted, active, own
from webchat.text.thinking_split import Markers, PartSplitter
from webchat.text.tokenizer import compile_chat_template

if TYPE_CHECKING:
    from webchat.text.tokenizer import Tokenizer

# (start, end) pairs reasoning models write: DeepSeek-R1 / Qwen3 / SmolLM3 / Phi-4-reasoning, Bespoke/OpenThoughts,
# Claude-style tags, Command R7B, Kimi, Seed-OSS
KNOWN_MARKERS = (("<think>", "</think>"), ("<|begin_of_thought|>", "<|end_of_thought|>"), ("<thinking>", "</thinking>"),
                 ("<|START_THINKING|>", "<|END_THINKING|>"), ("◁think▷", "◁/think▷"), ("<seed:think>", "</seed:think>"))
# variables webchat sets itself: a request's chat_template_kwargs may not override them
RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token",
                      "unk_token", "pad_token", "raise_exception", "strftime_now", "range", "namespace", "loop"})
PROBE_USER = [{"role": "user", "content": "\ue000u"}]


@dataclass(frozen=True)
class ThinkingFormat:
    """markers: how thinking is written; variables: the template's free variables a request may set (its
    chat_template_kwargs); close_text: what a reasoning budget forces to end thinking (the end marker with the
    whitespace the template writes around it); reads_reasoning: the template reads messages' reasoning_content."""

    markers: Markers
    variables: frozenset[str]
    close_text: str
    reads_reasoning: bool
    writes_markers: bool  # the template itself writes the end marker (it knows thinking)

    @property
    def switch(self) -> bool:
        """The template takes `enable_thinking` (Qwen3, SmolLM3, ...): the page offers a Think switch."""
        return "enable_thinking" in self.variables

    def wire(self) -> dict[str, Any]:
        return {"start": self.markers.start, "end": self.markers.end, "switch": self.switch}


def _single_id(tok: Tokenizer, text: str) -> bool:
    ids = tok.encode(text)
    if tok.add_bos_token and tok.bos_id is not None and ids[:1] == [tok.bos_id]:
        ids = ids[1:]
    return len(ids) == 1


def _markers(tok: Tokenizer, source: str) -> Markers:
    written = [m for m in KNOWN_MARKERS if m[1] in source]
    if written:
        return Markers(*written[0])
    in_vocab = [m for m in KNOWN_MARKERS if _single_id(tok, m[0]) and _single_id(tok, m[1])]
    return Markers(*(in_vocab[0] if in_vocab else KNOWN_MARKERS[0]))


def _variables(source: str) -> frozenset[str]:
    """The template's free variables (what a render may be given): the names it reads and never sets itself (a
    `{% set %}`, a loop's or a macro's names), less those webchat sets. Read from the syntax tree alone: jinja's
    meta.find_undeclared_variables runs its code generator with constant folding, which would build a hostile
    template's `''|center(10**9)` here, outside any budget."""
    try:
        tree = compile_chat_template(source).environment.parse(source)
    except jinja2.TemplateError:
        return frozenset()
    names = list(tree.find_all(jinja2.nodes.Name))
    stored = {n.name for n in names if n.ctx in ("store", "param")}
    return frozenset({n.name for n in names if n.ctx == "load"} - stored - RESERVED)


def _close_text(tok: Tokenizer, markers: Markers) -> str:
    """The text between an assistant message's thinking and its answer as the template renders them (Qwen3:
    "\\n</think>\\n\\n"), or the end marker between newlines where the template does not render thinking."""
    think, answer = "\ue000thinking", "\ue000answer"
    chat = [*PROBE_USER, {"role": "assistant", "content": answer, "reasoning_content": think}]
    text = _probe(tok, chat, False) or ""
    a, b = text.find(think), text.find(answer)
    between = text[a + len(think): b] if 0 <= a < b else ""
    return between if markers.end in between else f"\n{markers.end}\n\n"


def _probe(tok: Tokenizer, chat: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str | None:
    """A probe chat rendered under a budget of its own (the template is the model file's: it may be hostile), as
    small as the request's where that one is the event loop's (InlineExhausted then sends the request's work off the
    loop, webchat.serve.runtime.encode_text_work: nothing is cached); None where the template fails on it."""
    request = active()
    try:
        with own(INLINE if request is not None and request.inline else FULL):
            return tok.apply_chat_template(chat, add_generation_prompt, **kwargs)
    except InlineExhausted:
        raise
    except (jinja2.TemplateError, ValueError, TypeError, ArithmeticError, LookupError, AttributeError, RecursionError):
        return None


@functools.lru_cache(maxsize=16)
def thinking_format(tok: Tokenizer) -> ThinkingFormat:
    """A tokenizer's thinking format, read once from its chat template and vocabulary."""
    source = tok.chat_template or ""
    markers = _markers(tok, source)
    return ThinkingFormat(markers=markers, variables=_variables(source), close_text=_close_text(tok, markers),
                          reads_reasoning="reasoning_content" in source, writes_markers=markers.end in source)


def check_kwargs(kwargs: dict[str, Any]) -> None:
    """chat_template_kwargs: names a template can read, none that webchat sets itself; ValueError naming the key."""
    for key in kwargs:
        if not key.isidentifier():
            raise ValueError(f"chat_template_kwargs keys must be template variable names, got {key!r}")
        if key in RESERVED:
            raise ValueError(f"chat_template_kwargs may not set {key!r}: webchat sets it (reserved: "
                             f"{', '.join(sorted(RESERVED))})")


@functools.lru_cache(maxsize=64)
def _generation_prompt(tok: Tokenizer, kwargs_json: str) -> str:
    kwargs = json.loads(kwargs_json)
    full, base = _probe(tok, PROBE_USER, True, **kwargs), _probe(tok, PROBE_USER, False, **kwargs)
    if full is None or base is None:
        return ""  # a template that cannot render a one-question chat: the request's own render says why
    if full.startswith(base):
        return full[len(base):]
    probe = PROBE_USER[0]["content"]
    return full[full.rfind(probe) + len(probe):]  # a template that renders the chat apart: all after the question


def generation_prompt(tok: Tokenizer, kwargs: dict[str, Any] | None = None) -> str:
    """The text the template adds to open the reply (Qwen3: "<|im_start|>assistant\\n", with enable_thinking false
    "...<think>\\n\\n</think>\\n\\n"; DeepSeek-R1: "<｜Assistant｜><think>\\n")."""
    return _generation_prompt(tok, json.dumps(kwargs or {}, sort_keys=True))


def opens(text: str, markers: Markers) -> bool:
    """Whether `text` leaves thinking open: its last start marker comes after its last end marker."""
    start = text.rfind(markers.start)
    return start >= 0 and start > text.rfind(markers.end)


def has_markers(text: str, markers: Markers) -> bool:
    return markers.start in text or markers.end in text


def split_text(text: str, markers: Markers, inside: bool = False) -> tuple[str | None, str]:
    """A whole reply's text as (thinking, answer), markers and the whitespace after them taken out; thinking None when
    the text has none. The stream's own splitter, fed the text cut at its markers (one piece a marker)."""
    pattern = "(" + "|".join(re.escape(m) for m in (markers.start, markers.end)) + ")"
    splitter: PartSplitter[int] = PartSplitter(markers, inside)
    out = [o for i, piece in enumerate(p for p in re.split(pattern, text) if p) for o in splitter.push(i, piece)]
    out += splitter.flush()
    thinking = [piece for _, piece, part in out if part == "thinking"]
    answer = "".join(piece for _, piece, part in out if part == "answer")
    return ("".join(thinking) if inside or thinking else None), answer


def for_template(messages: list[dict[str, Any]], fmt: ThinkingFormat) -> list[dict[str, Any]]:
    """Assistant messages as a thinking template reads them: thinking written into the content (`<think>…</think>`,
    or before `</think>` where the prompt opened it) moved to `reasoning_content`, so the template keeps or drops it
    as it does for any client (Qwen3 keeps only the thinking after the last question). A template that knows no
    thinking gets the messages as they are."""
    if not (fmt.reads_reasoning or fmt.writes_markers):
        return messages
    out = []
    for m in messages:
        content = m.get("content")
        if m.get("role") != "assistant" or not isinstance(content, str) or "reasoning_content" in m \
                or not has_markers(content, fmt.markers):
            out.append(m)
            continue
        inside = fmt.markers.end in content and not content.lstrip().startswith(fmt.markers.start)
        thinking, answer = split_text(content, fmt.markers, inside)
        out.append({**m, "content": answer, **({"reasoning_content": thinking} if thinking is not None else {})})
    return out
