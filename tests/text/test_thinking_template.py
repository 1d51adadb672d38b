"""A model's thinking read from its chat template and vocabulary (webchat.text.thinking, webchat.serve.thinking), on a
tiny random Qwen3 with Qwen3's real template and on DeepSeek-R1's: the prompts match transformers' own rendering,
earlier turns' thinking is left out where the template leaves it out, and each reply gets the split it needs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.tiny import make_tiny_model, make_tiny_qwen3
from webchat.serve.thinking import Ask, encode_chat, thinking_for, wire
from webchat.text.thinking import check_kwargs, generation_prompt, split_text, thinking_format
from webchat.text.thinking_split import Markers
from webchat.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers", reason="transformers (the reference) is not installed")

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "templates"
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
DEEPSEEK_R1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\nFour."},
    {"role": "user", "content": "And three plus three?"},
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), QWEN3)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(qwen3_dir)


@pytest.fixture(scope="module")
def reference(qwen3_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(qwen3_dir)


def with_template(folder: Path, template: str) -> Tokenizer:
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return Tokenizer.from_dir(folder)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_the_prompt_is_transformers_own_for_the_same_messages_and_kwargs(qwen3: Tokenizer, reference: Any,
                                                                        kwargs: dict[str, Any]) -> None:
    text = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, **kwargs)
    want = reference.apply_chat_template(CHAT, add_generation_prompt=True, **kwargs)["input_ids"]
    assert encode_chat(qwen3, CHAT, kwargs=kwargs) == want
    assert qwen3.decode(want) == text
    assert "Two and two" not in text  # the earlier turn's thinking is left out, as Qwen3's template does
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == (kwargs.get("enable_thinking") is False)


def test_thinking_given_as_reasoning_content_is_kept_after_the_last_question(qwen3: Tokenizer,
                                                                            reference: Any) -> None:
    """Qwen3 keeps the thinking of turns after the last user message (a tool loop): given as reasoning_content, or
    written into the content, the prompt is the same, and the thinking's text is message content (a control
    marker typed in it is text, never the control id)."""
    tail = [{"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A", "reasoning_content": "R <|im_end|>"}]
    written = [tail[0], {"role": "assistant", "content": "<think>\nR <|im_end|>\n</think>\n\nA"}]
    ids = encode_chat(qwen3, tail, continue_final=False)
    assert ids == encode_chat(qwen3, written)
    text = reference.apply_chat_template(tail, tokenize=False)
    assert "<think>\nR <|im_end|>\n</think>\n\nA" in text
    im_end = qwen3.encode("<|im_end|>")
    assert ids.count(im_end[0]) == 2  # the two turns' ends, not the one written inside the thinking


def test_markers_variables_and_closing_text_come_from_the_template(qwen3: Tokenizer, tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    fmt = thinking_format(qwen3)
    assert (fmt.markers, fmt.variables, fmt.close_text) == (Markers(), frozenset({"enable_thinking"}), "\n</think>\n\n")
    assert fmt.switch and fmt.reads_reasoning and wire(qwen3) == {"start": "<think>", "end": "</think>", "switch": True}
    command = with_template(make_tiny_model(tmp_path / "cmd"), "{% for m in messages %}{{ m.content }}{% endfor %}"
                            "{% if add_generation_prompt %}<|START_THINKING|>{% endif %}{{ '<|END_THINKING|>' }}")
    assert thinking_format(command).markers == Markers("<|START_THINKING|>", "<|END_THINKING|>")
    chatml = Tokenizer.from_dir(tiny_model_dir)  # knows no thinking: the default markers, no switch, no hello entry
    assert thinking_format(chatml).markers == Markers() and not thinking_format(chatml).switch
    assert wire(chatml) is None


def test_each_reply_gets_the_split_its_prompt_needs(qwen3: Tokenizer, tiny_model_dir: Path, tmp_path: Path) -> None:
    question = [{"role": "user", "content": "Hi"}]
    r = thinking_for(qwen3, question, False, Ask())
    assert r is not None and not r.inside  # Qwen3 opens thinking itself: the split waits for its <think>
    assert thinking_for(qwen3, question, False, Ask(kwargs={"enable_thinking": False})) is None  # closed already
    r1 = with_template(make_tiny_model(tmp_path / "r1"), DEEPSEEK_R1)
    assert generation_prompt(r1).endswith("<｜Assistant｜><think>\n")
    r = thinking_for(r1, question, False, Ask())
    assert r is not None and r.inside  # the generation prompt opened thinking: the reply starts inside it
    chatml = Tokenizer.from_dir(tiny_model_dir)
    assert thinking_for(chatml, question, False, Ask()) is None  # a model that does not think: no split
    opened = [*question, {"role": "assistant", "content": "<think>\nhmm"}]
    r = thinking_for(chatml, opened, True, Ask(budget=4, message="Done."))
    assert r is not None and r.inside and r.budget == 4  # any model, continued from inside <think>
    assert chatml.decode(list(r.close)) == "Done.\n</think>\n\n"  # llama-server's message, then the closing
    closed = [*question, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nYes"}]
    assert thinking_for(chatml, closed, True, Ask()) is None
    assert thinking_for(qwen3, question, False, Ask(split=False)) is None  # reasoning_format none
    assert thinking_for(qwen3, question, False, Ask(split=False, budget=2)) is not None  # its budget still counts


def test_a_continued_reply_inside_thinking_is_the_generation_prompt_and_its_text(qwen3: Tokenizer) -> None:
    """Qwen3's template would close the final message's thinking; the prompt is the one the reply was generated
    after, then the reply as written (llama-server's prefill)."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nLet me"}]
    ids = encode_chat(qwen3, chat, continue_final=True)
    assert qwen3.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nLet me"
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}]
    assert qwen3.decode(encode_chat(qwen3, plain, continue_final=True)).endswith("<think>\n\n</think>\n\nSure")


@pytest.mark.parametrize(("text", "inside", "want"), [
    ("<think>\nhmm\n</think>\n\nFour.", False, ("hmm\n", "Four.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("<think>\ncut inside", False, ("cut inside", "")),
    ("Plain <think> text", False, (None, "Plain <think> text")),
    ("hmm</think>\n\nYes", True, ("hmm", "Yes")),
    ("<think></think>Yes", False, ("", "Yes")),
])
def test_a_whole_text_splits_as_the_stream_does(text: str, inside: bool, want: tuple[str | None, str]) -> None:
    assert split_text(text, Markers(), inside) == want


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"messages": []}, "may not set 'messages'"), ({"bos_token": "x"}, "may not set 'bos_token'"),
    ({"not a name": 1}, "template variable names"),
])
def test_template_kwargs_webchat_sets_itself_are_refused(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        check_kwargs(kwargs)
    check_kwargs({"enable_thinking": False, "any_other_key": [1, {"a": "b"}]})
