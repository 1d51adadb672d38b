"""Thinking apart from the answer (webchat.text.thinking_split and the engine's use of it): the split does not depend on
how the text is cut into tokens or chunks, a reply that starts inside thinking or is cut inside it stays thinking,
and a reasoning budget forces the closing marker after that many thinking tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings
from webchat.kernels.backend import load_model
from webchat.text.thinking_split import Markers, PartSplitter, Thinking
from webchat.text.tokenizer import Tokenizer

GREEDY = SamplingSettings(temperature=0.0)


def split(pieces: list[str], inside: bool = False, markers: Markers | None = None) -> tuple[str, str, list[str]]:
    """(thinking text, answer text, each piece's part) of a stream of pieces."""
    s: PartSplitter[int] = PartSplitter(markers or Markers(), inside)
    out = [o for i, p in enumerate(pieces) for o in s.push(i, p)] + s.flush()
    assert [i for i, _, _ in out] == list(range(len(pieces)))  # every token once, in order
    thinking = "".join(p for _, p, part in out if part == "thinking")
    answer = "".join(p for _, p, part in out if part == "answer")
    return thinking, answer, [part for _, _, part in out]


def cuts(text: str, points: list[int]) -> list[str]:
    at = sorted({min(p, len(text)) for p in points} | {0, len(text)})
    return [text[a:b] for a, b in zip(at, at[1:], strict=False)]


def test_a_reply_that_opens_thinking() -> None:
    assert split(["<think>", "\n", "Let me", " see", "\n", "</think>", "\n\n", "It is", " 42."])[:2] == \
        ("Let me see\n", "It is 42.")
    assert split(["Plain", " answer <think> not thinking"])[:2] == ("", "Plain answer <think> not thinking")
    assert split(["  ", "<think>", "x", "</think>", "y"])[:2] == ("x", "y")


def test_a_reply_that_starts_inside_thinking_and_one_cut_inside_it() -> None:
    assert split(["hmm", " so", "</think>", "Yes"], inside=True)[:2] == ("hmm so", "Yes")
    thinking, answer, parts = split(["<think>", "still", " going", " </thi"])
    assert (thinking, answer) == ("still going </thi", "")  # a marker never completed is text, of the part it is in
    assert set(parts) == {"thinking"}


def test_other_markers() -> None:
    m = Markers("<|begin_of_thought|>", "<|end_of_thought|>")
    assert split(["<|begin_of_", "thought|>", "a", "<|end_of_thought|>", "b"], markers=m)[:2] == ("a", "b")
    with pytest.raises(ValueError, match="non-empty"):
        Markers("", "</think>")


TEXT = st.text(alphabet=st.sampled_from(list("ab <>/thinkT\n")), max_size=40)


@settings(max_examples=300, deadline=None)
@given(before=TEXT, thinking=TEXT, answer=TEXT, points=st.lists(st.integers(0, 200), max_size=12))
def test_the_split_does_not_depend_on_where_the_text_is_cut(before: str, thinking: str, answer: str,
                                                             points: list[int]) -> None:
    """Any text, cut anywhere that does not put a marker and other text in one piece (a token that does keeps only
    one side's text, by design): the same thinking and answer as the text cut into single characters, each marker
    whole."""
    text = f"{before}<think>{thinking}</think>{answer}" if not before.strip() else before + answer
    bounds = [i for m in ("<think>", "</think>") for span in _spans(text, m) for i in span]
    inside = {i for m in ("<think>", "</think>") for a, b in _spans(text, m) for i in range(a + 1, b)}
    chars = cuts(text, [i for i in range(len(text)) if i not in inside])
    assert split(cuts(text, points + bounds))[:2] == split(chars)[:2]


def _spans(text: str, marker: str) -> list[tuple[int, int]]:
    out, at = [], text.find(marker)
    while at >= 0:
        out.append((at, at + len(marker)))
        at = text.find(marker, at + 1)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


def run(model: Any, tok: Tokenizer, req: GenerationRequest) -> list[Any]:
    gen = Generator(model, tok)
    gen.begin_stream(req)
    tokens = []
    while True:
        res = gen.stream()
        tokens += res.tokens
        if res.eos:
            return tokens


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_a_reasoning_budget_closes_thinking_after_that_many_tokens(tiny: tuple[Any, Tokenizer], budget: int) -> None:
    model, tok = tiny
    close = tok.encode("</think>")
    r = Thinking(inside=True, budget=budget, close=tuple(close))
    tokens = run(model, tok, GenerationRequest(prompt_ids=tok.encode("Question?"), settings=GREEDY,
                                               max_new_tokens=budget + len(close) + 6, stop_token_ids=[],
                                               thinking=r, return_probs=True))
    ids = [t.id for t in tokens]
    assert ids[budget : budget + len(close)] == close  # forced right after the budget
    parts = [t.part for t in tokens]
    assert parts[:budget] == ["thinking"] * budget
    assert parts[budget + len(close):] == ["answer"] * (len(tokens) - budget - len(close))
    assert all(t.prob is not None for t in tokens)  # forced tokens keep the model's probability
    unbounded = run(model, tok, GenerationRequest(prompt_ids=tok.encode("Question?"), settings=GREEDY,
                                                  max_new_tokens=12, stop_token_ids=[],
                                                  thinking=Thinking(inside=True)))
    assert {t.part for t in unbounded} == {"thinking"}  # never closed by itself: thinking to the end


def test_a_budget_needs_its_closing_tokens() -> None:
    with pytest.raises(ValueError, match="reasoning budget"):
        Thinking(budget=3)
