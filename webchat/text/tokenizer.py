"""A model folder's tokenizer: `tokenizers` encodes/decodes, sandboxed Jinja2 renders the chat template as HF does."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from tokenizers import Tokenizer as HFTokenizer

from webchat.text.chat_encode import chat_parts
from webchat.text.template_budget import render
from webchat.text.template_sandbox import BudgetedSandbox

CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<|eom_id|>", "<end_of_turn>")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable char map (byte-level BPE vocabularies are written in these chars)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
# char -> the byte it stands for, as latin-1; other chars below 256 -> U+FFFF so that encoding fails and falls back
_TO_LATIN1 = str.maketrans({**{chr(i): "\uffff" for i in range(256)}, **{c: chr(b) for c, b in BYTE_DECODER.items()}})


def _byte_level_bytes(token: str) -> bytes:
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:  # a char outside GPT-2's map (rare): its own UTF-8
        return b"".join(bytes([BYTE_DECODER[c]]) if c in BYTE_DECODER else c.encode("utf-8") for c in token)


def _sentencepiece_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode("utf-8")


GIL_FREE_CHARS = 4096  # past this many characters a text is encoded with the GIL released


def _encode(tok: HFTokenizer, text: str) -> Any:
    """tok.encode(text) without special tokens. A long text goes through `encode_batch`, which releases the GIL
    (`encode` holds it: 0.63 s for 728 KB of tool schemas, every other thread of the server stopped meanwhile);
    the ids and offsets are the same."""
    if len(text) <= GIL_FREE_CHARS:
        return tok.encode(text, add_special_tokens=False)
    return tok.encode_batch([text], add_special_tokens=False)[0]


def _is_byte_level(spec: dict[str, Any]) -> bool:
    """True when tokenizer.json decodes with ByteLevel (GPT-2 style vocab), False for sentencepiece-style vocabs."""
    text = json.dumps([spec.get("decoder"), spec.get("pre_tokenizer")])
    return '"ByteLevel"' in text


def _token_content(value: Any) -> str | None:
    """tokenizer_config writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    """The template from chat_template.jinja, or tokenizer_config's chat_template (a string or named list)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (Hugging Face's assistant-mask tag) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile as transformers does: sandboxed, trim_blocks, lstrip_blocks, loopcontrols, its globals and tojson.

    The sandbox also holds each render to its step, character, output and time budgets
    (webchat.text.template_budget).
    """
    env = BudgetedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                         **context: Any) -> str:  # fmt: skip
    """Render as transformers' apply_chat_template(tokenize=False): tools/documents None unless given."""
    chat = [dict(m) for m in messages]
    variables: dict[str, Any] = {"tools": None, "documents": None, **context}
    variables.update(messages=chat, add_generation_prompt=add_generation_prompt)
    return render(compile_chat_template(source), source, variables)


def _display(raw: bytes) -> str:
    """Text of a token's bytes; bytes that are not whole UTF-8 characters show as <0xNN>."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="surrogateescape")
    return "".join(f"<0x{ord(c) - 0xDC00:02X}>" if 0xDC80 <= ord(c) <= 0xDCFF else c for c in text)


class Tokenizer:
    """Encode/decode, exact token bytes and the chat template of one Hugging Face-style model folder."""

    def __init__(self, tokenizer: HFTokenizer, spec: dict[str, Any], tok_config: dict[str, Any],
                 gen_config: dict[str, Any], chat_template: str | None) -> None:  # fmt: skip
        self._tok = tokenizer
        self._tok_text = HFTokenizer.from_str(tokenizer.to_str())  # the same, special tokens read as plain text
        self._tok_text.encode_special_tokens = True
        self._control = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.add_bos_token = bool(tok_config.get("add_bos_token", False))
        self.special_tokens = {k: t for k in SPECIAL_KEYS if (t := _token_content(tok_config.get(k))) is not None}
        self.bos_id = self._special_id("bos_token", gen_config.get("bos_token_id"))
        self.eos_id = self._special_id("eos_token", gen_config.get("eos_token_id"))
        self._stop_ids = self._find_stop_ids(gen_config.get("eos_token_id"))
        self.chat_template = chat_template
        self._bytes = self._bytes_table(_is_byte_level(spec))  # hot: one entry per id, built once
        self._text = [_display(b) for b in self._bytes]

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{folder}: expected a tokenizer.json, found none")
        tok_config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json") or _read_json(folder / "config.json")
        spec = json.loads(tok_file.read_text(encoding="utf-8"))
        return cls(
            HFTokenizer.from_file(str(tok_file)), spec, tok_config, gen_config, _chat_template(folder, tok_config)
        )

    def _special_id(self, key: str, fallback: Any) -> int | None:
        text = self.special_tokens.get(key)
        idx = self._tok.token_to_id(text) if text is not None else None
        if idx is None and isinstance(fallback, list):
            fallback = fallback[0] if fallback else None
        return int(idx) if idx is not None else (int(fallback) if isinstance(fallback, int) else None)

    def _find_stop_ids(self, gen_eos: Any) -> list[int]:
        ids: list[int] = [] if self.eos_id is None else [self.eos_id]
        ids += gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        ids += [i for t in CHAT_END_TOKENS if (i := self._tok.token_to_id(t)) is not None]
        return list(dict.fromkeys(ids))

    def _bytes_table(self, byte_level: bool) -> list[bytes]:
        added = set(self._tok.get_added_tokens_decoder())
        to_bytes = _byte_level_bytes if byte_level else _sentencepiece_bytes
        table = [b""] * self.vocab_size  # ids missing from the vocab (holes) contribute nothing
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if 0 <= i < self.vocab_size:
                table[i] = token.encode("utf-8") if i in added else to_bytes(token)
        return table

    @property
    def stop_token_ids(self) -> list[int]:
        """eos, generation_config's eos ids and the chat end tokens present in the vocab."""
        return list(self._stop_ids)

    def encode(self, text: str) -> list[int]:
        """Special tokens written in text become their single ids; BOS only if add_bos_token (and not already there)."""
        ids: list[int] = _encode(self._tok, text).ids
        if self.add_bos_token and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Every character read as text: "<|im_end|>" written in it is those characters, never the control id."""
        ids: list[int] = _encode(self._tok_text, text).ids
        if self.add_bos_token and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final: bool = False, tools: list[dict[str, Any]] | None = None, *,
                    expand: Callable[[str], str] | None = None, **template_kwargs: Any) -> list[int]:  # fmt: skip
        """The chat prompt's ids, message contents tokenized as text: only the template's own markers are control ids.

        continue_final: end right after the final message's content (no end-of-turn, no generation prompt).
        template_kwargs: more variables for the template (a request's chat_template_kwargs: `enable_thinking`).
        expand: applied to the template's own text before it is tokenized (an image's marker written out as its
        layout, webchat.serve.images), never to a message's content.
        Usually the ids of `encode(apply_chat_template(...))`; where a content holds a special token's text, that
        content is encoded on its own with special tokens read as text.
        """
        extra = {**template_kwargs, **({"tools": tools} if tools else {})}  # `tools`: webchat.text.toolformat
        if self.reads_parts_only:
            messages = [_as_parts(m) for m in messages]
        parts = chat_parts(lambda msgs: self.apply_chat_template(msgs, add_generation_prompt and not continue_final,
                                                                 **extra), messages, continue_final)  # fmt: skip
        if expand is not None:
            parts = [(t if is_content else expand(t), is_content) for t, is_content in parts]
        text = "".join(t for t, _ in parts)
        enc = _encode(self._tok, text)
        spans, pos = [], 0
        for t, is_content in parts:
            if is_content:
                spans.append((pos, pos + len(t)))
            pos += len(t)
        forged = any(tid in self._control and any(s < end and start < e for s, e in spans)
                     for tid, (start, end) in zip(enc.ids, enc.offsets, strict=True))
        ids: list[int] = list(enc.ids)
        if forged:  # re-encode part by part: only the template's parts parse special tokens
            ids = []
            for t, is_content in parts:
                ids += _encode(self._tok_text if is_content else self._tok, t).ids
        if self.add_bos_token and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    @functools.cached_property
    def reads_parts_only(self) -> bool:
        """Whether the chat template shows a message's text only when given as parts (SmolVLM's iterates the content
        as a list: a string's characters show nothing); such a template gets every text content as one text part."""
        probe = "\ue000probe\ue001"
        try:
            as_text = self.apply_chat_template([{"role": "user", "content": probe}], False)
            as_parts = self.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": probe}]}], False)
        except Exception:  # noqa: BLE001 - a template that refuses either: it is given what it is given
            return False
        return probe not in as_text and probe in as_parts

    def token_id(self, text: str) -> int | None:
        """The id of the one token spelt `text` (special or not, e.g. a vision model's `<image>`), None if none is."""
        i = self._tok.token_to_id(text)
        return int(i) if i is not None else None

    def control_id(self, text: str) -> int | None:
        """The id of the special (control) token spelt `text`, e.g. a template's `[TOOL_CALLS]`; None if none is."""
        i = self._tok.token_to_id(text)
        return int(i) if i is not None and i in self._control else None

    def to_json(self) -> str:
        """The `tokenizers` JSON of this vocabulary (a grammar library builds its token trie from it)."""
        return str(self._tok.to_str())

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes the token contributes to the text (special tokens: the UTF-8 of their text)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id must be in [0, {self.vocab_size}), got {token_id}")
        return self._bytes[token_id]

    def id_to_text(self, token_id: int) -> str:
        """Display text of one token; a partial UTF-8 character shows as <0xNN>."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id must be in [0, {self.vocab_size}), got {token_id}")
        return self._text[token_id]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:  # fmt: skip
        """Render the folder's chat template as transformers' apply_chat_template(tokenize=False) does."""
        if self.chat_template is None:
            raise ValueError("this model folder has no chat template (tokenizer_config.json chat_template)")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt, **self.special_tokens, **kwargs
        )


def _as_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is text, with that text as one text part."""
    content = message.get("content")
    return {**message, "content": [{"type": "text", "text": content}]} if isinstance(content, str) else message
