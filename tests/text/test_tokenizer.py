"""Our tokenizer against transformers' tokenizer of the original GGUF, and on a sentencepiece-style folder."""

from __future__ import annotations

import json
import random
import sys
import unicodedata
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from webchat.text.tokenizer import Tokenizer, render_chat_template

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Best emoji? 🎉🔥👍🏽"}],
    [{"role": "user", "content": "Переведи: «доброе утро» — 早上好！ おはようございます。"}],
    [
        {"role": "user", "content": "مرحبا، كيف حالك؟ שלום! नमस्ते 🙏"},
        {"role": "assistant", "content": "I'm fine 😊, thanks."},
        {"role": "user", "content": "Write x = 3.14159 * r**2\n\tin  Python 🐍 (über-café)."},
    ],
    [{"role": "system", "content": "Tu es concis."}, {"role": "user", "content": "Ça va? 👨‍👩‍👧‍👦 🇫🇷 ≈ ≠ ∞"}],
    [{"role": "user", "content": "  leading spaces, trailing\n\n\nnewlines <b>html</b> & 'quotes' \"dq\"  "}],
]


@pytest.fixture(scope="module")
def ours(real_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(real_model_dir)


@pytest.fixture(scope="module")
def ref(real_gguf_path: Path) -> Any:
    """The independent reference: transformers' own tokenizer built from the original GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_gguf_path.parent), gguf_file=real_gguf_path.name)


def ref_ids(ref: Any, text: str) -> list[int]:
    return list(ref.encode(text, add_special_tokens=False))


# ---- chat template and prompts (real model) -----------------------------------------------------------------------


@pytest.mark.real_model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("idx", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(ours: Tokenizer, ref: Any, idx: int, add_generation_prompt: bool) -> None:
    msgs = CONVERSATIONS[idx]
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ours.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
    assert got == want
    has_system = msgs[0]["role"] == "system"
    assert ("You are a helpful AI assistant named SmolLM" in got) != has_system  # the template's default system prompt
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.real_model
@pytest.mark.parametrize("idx", range(len(CONVERSATIONS)))
def test_prompt_ids_match_reference_and_round_trip(ours: Tokenizer, ref: Any, idx: int) -> None:
    text = ours.apply_chat_template(CONVERSATIONS[idx])
    ids = ours.encode(text)
    assert ids == ref_ids(ref, text)
    assert ours.decode(ids) == text
    assert b"".join(ours.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert ids[0] == ours.bos_id == 1 and ids.count(ours.eos_id) == text.count("<|im_end|>")


# Random text. transformers' GGUF tokenizer omits the `smollm` pre-tokenizer's digit split (see MODEL_FACTS), which the
# GGUF's own tokenizer (llama.cpp) and SmolLM2's original tokenizer.json apply first: every numeric character (category
# N, ASCII digits included) is its own piece before GPT-2's regex runs. That changes ids in two ways: BPE merges across
# non-ASCII digits or with the space before them ("Ġ" + first byte), and the regex groups whitespace differently before
# a digit ("\n 1": GPT-2 takes "\n" + " 1", the split takes "\n " + "1"). So the reference is used two ways: directly on
# the strings with no numeric character, and with the digit split applied in front (piece by piece) on all of them.
SCRIPTS = [
    (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0x3040, 0x30FF),
    (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x2000, 0x206F), (0x2190, 0x22FF), (0x1F300, 0x1FAFF), (0x300, 0x36F),
    (0xFE00, 0xFE0F), (0x2150, 0x218F), (0x2460, 0x24FF),  # the last two: number forms, enclosed numerals
]  # fmt: skip
WHITESPACE = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u200d", "\u00a0", "\u3000"]
DIGIT_SPLIT = pre_tokenizers.Digits(individual_digits=True)


def random_text(rng: random.Random) -> str:
    out: list[str] = []
    for _ in range(rng.randint(1, 40)):
        r = rng.random()
        if r < 0.15:
            out.append(rng.choice(WHITESPACE))
            continue
        lo, hi = (0x20, 0x7E) if r < 0.5 else rng.choice(SCRIPTS) if r < 0.85 else (0x20, sys.maxunicode)
        c = chr(rng.randint(lo, hi))
        if unicodedata.category(c) not in ("Cs", "Cn", "Co"):  # no surrogates, unassigned or private-use
            out.append(c)
    return "".join(out)


def has_numeric(text: str) -> bool:
    return any(unicodedata.category(c).startswith("N") for c in text)


def ref_ids_digit_split(ref: Any, text: str) -> list[int]:
    """The reference with the `smollm` digit split in front: its pipeline run on each piece."""
    return [i for piece, _ in DIGIT_SPLIT.pre_tokenize_str(text) for i in ref_ids(ref, piece)]


@pytest.mark.real_model
def test_random_unicode_matches_reference_and_round_trips(ours: Tokenizer, ref: Any) -> None:
    rng = random.Random(1234)
    texts = [random_text(rng) for _ in range(400)]
    plain = [t for t in texts if not has_numeric(t)]
    assert len(plain) >= 100 and len(texts) - len(plain) >= 100  # both kinds well represented
    differ = [t for t in plain if ours.encode(t) != ref_ids(ref, t)]
    assert differ == [], f"{len(differ)} of {len(plain)} strings without digits differ, e.g. {differ[:3]!r}"
    differ = [t for t in texts if ours.encode(t) != ref_ids_digit_split(ref, t)]
    assert differ == [], f"{len(differ)} of {len(texts)} differ from the digit-split reference, e.g. {differ[:3]!r}"
    for t in texts:
        ids = ours.encode(t)
        assert ours.decode(ids) == t
        assert b"".join(ours.token_bytes(i) for i in ids) == t.encode("utf-8")


@pytest.mark.real_model
def test_digits_split_one_by_one(ours: Tokenizer, ref: Any) -> None:
    texts = ["Pi is 3.14159 and 2024", "عام ١٤٤٥ هـ", "वर्ष २०२४", "x² + y³ = ½", "Chapter Ⅻ ⑤", " 12345 ٣٤ 7"]
    for text in texts:
        ids = ours.encode(text)
        # every numeric character is a token boundary on both sides: the tokens' bytes cut at each one
        cuts, pos = {0}, 0
        for i in ids:
            pos += len(ours.token_bytes(i))
            cuts.add(pos)
        for k, c in enumerate(text):
            if unicodedata.category(c).startswith("N"):
                start = len(text[:k].encode("utf-8"))
                assert start in cuts and start + len(c.encode("utf-8")) in cuts, (text, c)
        assert ids == ref_ids_digit_split(ref, text)
    assert len(ours.encode("12345")) == 5


@pytest.mark.real_model
def test_special_tokens_map_to_single_ids(ours: Tokenizer, ref: Any) -> None:
    for i in range(17):  # ids 0-16 are the GGUF's control tokens
        text = ours.id_to_text(i)
        assert text.startswith("<") and text.endswith(">")
        ids = ours.encode(f"a{text}b")
        assert ids.count(i) == 1 and len(ids) == 3 and ids == ref_ids(ref, f"a{text}b")
        assert ours.token_bytes(i) == text.encode("utf-8")
    assert ours.encode("<|im_start|>")[0] == ours.bos_id == 1 and ours.eos_id == 2
    assert ours.vocab_size == 49152 and 2 in ours.stop_token_ids and 0 in ours.stop_token_ids
    assert ours.encode("<|im_end") != [2]


@pytest.mark.real_model
def test_token_bytes_undo_byte_level_mapping(ours: Tokenizer) -> None:
    space_the = ours.encode(" the")
    assert len(space_the) == 1 and ours.token_bytes(space_the[0]) == b" the" and ours.id_to_text(space_the[0]) == " the"
    emoji = ours.encode("🐍")
    assert b"".join(ours.token_bytes(i) for i in emoji) == "🐍".encode()
    if len(emoji) > 1:  # a partial UTF-8 character is shown by its bytes
        assert ours.id_to_text(emoji[0]).startswith("<0xF0>")
    newline = ours.encode("\n")
    assert [ours.token_bytes(i) for i in newline] == [b"\n"]
    with pytest.raises(ValueError, match=r"token id must be in \[0, 49152\), got 49152"):
        ours.token_bytes(49152)


# ---- no real model needed ------------------------------------------------------------------------------------------


def write_sentencepiece_folder(out: Path) -> None:
    """A Llama-2-style tokenizer.json: ▁ for spaces, <0xNN> byte fallback, bos as a dict, a named template list."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "ll", "he", "▁he", "▁hell", "▁hello", "▁wor", "▁world"]
    vocab = {t: i for i, t in enumerate(specials + byte_tokens + words)}
    merges = [("▁", "h"), ("▁", "w"), ("l", "l"), ("h", "e"), ("▁h", "e"), ("▁he", "ll"), ("▁hell", "o"),
              ("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d")]  # fmt: skip
    vocab.update({"▁wo": len(vocab), "▁worl": len(vocab) + 1})
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    cfg = {
        "add_bos_token": True,
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": template}],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2]}))


def test_sentencepiece_style_folder(tmp_path: Path) -> None:
    write_sentencepiece_folder(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.stop_token_ids) == (1, 2, [2])
    ids = tok.encode("hello world é")
    assert ids[0] == 1  # add_bos_token
    assert [tok.id_to_text(i) for i in ids[1:4]] == [" hello", " world", " "]
    assert b"".join(tok.token_bytes(i) for i in ids[1:]) == " hello world é".encode()  # é via <0xC3><0xA9>
    assert tok.id_to_text(ids[-1]) == "<0xA9>"
    assert tok.decode(ids[1:]) == "hello world é"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<s>[user] hi</s>"
    assert tok.encode(prompt).count(1) == 1  # BOS already in the text is not added twice


TEMPLATE_FEATURES = """{%- set ns = namespace(n=0) -%}
{% for m in messages %}
    {% if m['role'] == 'stop' %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {{ m['role'] }}: {{ m['content'] | tojson }}
{% endfor %}
n={{ ns.n }} year={{ strftime_now('%Y') }} extra={{ custom_flag }}{{ eos_token }}
{% if add_generation_prompt %}assistant:{% endif %}"""


def test_template_rendering_matches_transformers() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = [
        {"role": "user", "content": 'héllo <b> "q" 🌍'},
        {"role": "stop", "content": ""},
        {"role": "x", "content": "y"},
    ]
    got = render_chat_template(TEMPLATE_FEATURES, msgs, add_generation_prompt=True, eos_token="</s>", custom_flag=7)
    want, _ = render_jinja_template(
        [msgs], chat_template=TEMPLATE_FEATURES, add_generation_prompt=True, eos_token="</s>", custom_flag=7
    )
    assert got == want[0]
    assert '"héllo <b> \\"q\\" 🌍"' in got and "n=1" in got  # tojson keeps non-ASCII and HTML as they are
    with pytest.raises(jinja2.TemplateError, match="bad role: user"):
        render_chat_template("{{ raise_exception('bad role: ' + messages[0]['role']) }}", msgs)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", msgs)


@pytest.mark.real_model
@pytest.mark.parametrize("final", ["Sure, here", "Line one\n- item ", "  spaced  "])
def test_continue_final_matches_transformers(ours: Tokenizer, ref: Any, final: str) -> None:
    """encode_chat(continue_final=True) gives the ids of transformers' continue_final_message text."""
    msgs = [*CONVERSATIONS[3], {"role": "assistant", "content": final}]
    text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert text.rstrip().endswith(final.strip()) and not text.endswith("<|im_end|>\n")
    assert ours.encode_chat(msgs, continue_final=True) == ref_ids(ref, text)


def test_tiny_model_folder_loads(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi 42 ü"}])
    ids = tok.encode(text)
    assert tok.decode(ids) == text and b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.eos_id in tok.stop_token_ids
