"""A GGUF file's vocabulary (`tokenizer.ggml.*`) as a `tokenizers` Tokenizer that splits text as llama.cpp does.

Two kinds are read:
- `gpt2`: byte-level BPE with the file's merges and a pre-tokenizer picked by `tokenizer.ggml.pre`.
- `llama`: SentencePiece BPE (Llama 1/2, Mistral v0.1, Gemma 2/3, Phi-3). The file holds pieces, scores and types but
  no merges. llama.cpp (`llm_tokenizer_spm`) merges, over and over, the adjacent pair whose joined piece is in the
  vocabulary with the highest score (leftmost on a tie), then spells what is left as <0xNN> byte pieces; a BPE whose
  merges are every split of every normal piece, ranked by the joined piece's score, merges in that same order. A space
  is "▁"; with `add_space_prefix` (llama.cpp's default for this kind; Gemma's files turn it off) each stretch of text
  after the start or a special token gets a leading "▁", as llama.cpp prepends it. Control pieces are special tokens,
  user-defined pieces are matched whole in the raw text (llama.cpp's `tokenizer_st_partition`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

NORMAL, UNKNOWN, CONTROL = int(gguf.TokenType.NORMAL), int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL)
USER_DEFINED, BYTE = int(gguf.TokenType.USER_DEFINED), int(gguf.TokenType.BYTE)
SPACE = "\u2581"  # SentencePiece's visible space
# llama.cpp's `tokenizer.ggml.pre` -> the Hugging Face pre-tokenizer that splits text the same way
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL_PRES = ("smollm", "gpt-2", "default", "llama-bpe", "qwen2")


class VocabError(ValueError):
    """The file's vocabulary is of a kind, or has a part, that webchat does not read."""


class Fields:
    """The `tokenizer.ggml.*` values one vocabulary needs (read from a GGUFReader by the converter)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def get(self, key: str, default: Any = None) -> Any:
        v = self.values.get(f"tokenizer.ggml.{key}")
        return default if v is None else v

    def need(self, key: str) -> Any:
        v = self.values.get(f"tokenizer.ggml.{key}")
        if v is None:
            raise VocabError(f"GGUF metadata key 'tokenizer.ggml.{key}' is missing")
        return v


def build_tokenizer(fields: Fields) -> HFTokenizer:
    kind = fields.need("model")
    if kind == "gpt2":
        return byte_level(fields)
    if kind == "llama":
        return sentencepiece(fields)
    raise VocabError(f"tokenizer.ggml.model {kind!r} is not supported; expected 'gpt2' (byte-level BPE) or 'llama' "
                     "(SentencePiece)")


def pre_tokenizer_for(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits one by one, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_split])
    if pre in ("gpt-2", "default"):
        return byte_level_split
    if pre in ("llama-bpe", "llama3", "qwen2"):
        pattern = LLAMA3_PATTERN if pre != "qwen2" else LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise VocabError(f"tokenizer.ggml.pre {pre!r} is not supported; expected one of {', '.join(BYTE_LEVEL_PRES)}")


def byte_level(fields: Fields) -> HFTokenizer:
    """Byte-level BPE from `tokenizer.ggml.{tokens,merges,token_type}`; control tokens become special tokens."""
    tokens: list[str] = fields.need("tokens")
    types: list[int] = fields.get("token_type", [NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in fields.need("merges")]
    pre = str(fields.get("pre", "default"))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                     ignore_merges=pre in ("llama-bpe", "llama3"))
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizer_for(pre)
    tok.decoder = decoders.ByteLevel()
    _add_marked(tok, tokens, types)
    return tok


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Every split of every normal piece into two pieces of the vocabulary, best joined piece first (score, then id)."""
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if types[i] == NORMAL:
            ids.setdefault(t, i)
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-float(scores[i]), i, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece(fields: Fields) -> HFTokenizer:
    tokens: list[str] = fields.need("tokens")
    scores: list[float] = fields.need("scores")
    types: list[int] = fields.get("token_type", [NORMAL] * len(tokens))
    if not len(tokens) == len(scores) == len(types):
        raise VocabError(f"tokenizer.ggml: {len(tokens)} tokens, {len(scores)} scores and {len(types)} types differ")
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in tokens]
    if missing:
        raise VocabError(f"the SentencePiece vocabulary lacks the byte piece(s) {', '.join(missing[:3])}; webchat "
                         "reads only vocabularies with byte fallback")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk_id = fields.get("unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else next(
        (t for t, k in zip(tokens, types, strict=True) if k == UNKNOWN), None)
    bpe = models.BPE(vocab, spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = HFTokenizer(bpe)
    prefix = bool(fields.get("add_space_prefix", True))  # llama.cpp's default for a SentencePiece vocabulary
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE)]
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), *steps] if prefix else steps)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_marked(tok, tokens, types)
    return tok


def _add_marked(tok: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control pieces as special tokens, user-defined ones as added tokens: both matched whole in the raw text."""
    tok.add_tokens([AddedToken(tokens[i], special=t == CONTROL, normalized=False)
                    for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED) and tokens[i]])


def special_tokens(fields: Fields) -> dict[str, str]:
    """tokenizer_config's bos/eos/pad/unk_token from the file's ids."""
    tokens: list[str] = fields.need("tokens")
    out: dict[str, str] = {}
    for name, key in {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}.items():
        idx = fields.get(f"{key}_token_id")
        if idx is not None:
            out[f"{name}_token"] = tokens[int(idx)]
    return out
