"""The prefix cache and images (webchat.engine.images' cache_ids): the next turn of a conversation, which sends the
image again, reuses its pages and never encodes it again; two different images never share pages, however alike
their prompts; the same image in another conversation reuses them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from bench import vision_fidelity as vf
from tests.vision.pictures import picture
from webchat.engine.sequence import GenerationRequest, StreamResult
from webchat.engine.settings import SamplingSettings
from webchat.serve.requests import Turn
from webchat.vision.projector import Projector


@pytest.fixture(scope="module", params=["idefics3", "gemma3"])
def rt(request: pytest.FixtureRequest, fixtures: dict[str, Any]) -> Iterator[Any]:
    yield vf.runtime(fixtures[request.param], "exact")


@pytest.fixture
def encodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tiles through the encoder, call by call."""
    calls: list[int] = []
    original = Projector.encode_tiles

    def counted(self: Projector, tiles: Any) -> Any:
        calls.append(int(tiles.shape[0]))
        return original(self, tiles)

    monkeypatch.setattr(Projector, "encode_tiles", counted)
    return calls


def prepare(rt: Any, messages: list[dict[str, Any]]) -> GenerationRequest:
    turn = Turn(messages=messages, settings=lambda _: SamplingSettings(temperature=0.0), max_new_tokens=6, fit=False)
    request: GenerationRequest = asyncio.run(rt.prep.chat(turn)).request
    return request


def run(gen: Any, request: GenerationRequest) -> tuple[str, StreamResult]:
    gen.begin_stream(request)
    text = ""
    while True:
        result = gen.stream()
        text += result.text
        if result.eos:
            return text, result


def user(url: str, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image", "url": url}, {"type": "text", "text": text}]}


def fresh(rt: Any) -> None:
    rt.local()[2].reset()
    rt.vision.projector.cache.clear()


def test_the_next_turn_reuses_the_images_pages_and_never_encodes_it(rt: Any, encodes: list[int]) -> None:
    fresh(rt)
    url = vf.data_url(picture(900, 600, 21))
    gen = rt.new_generator()
    first = prepare(rt, [user(url, "What is this?")])
    reply, done = run(gen, first)
    assert done.stats is not None and done.stats.encode_ms > 0 and len(encodes) == 1
    second = prepare(rt, [user(url, "What is this?"), {"role": "assistant", "content": reply or "A picture."},
                          {"role": "user", "content": "And its colours?"}])
    _, again = run(gen, second)
    assert again.stats is not None
    (image,) = second.images
    start, count = image.spans[-1]
    assert again.stats.reused_tokens >= start + count  # the image's slots and the text before them: from the cache
    assert again.stats.encode_ms == 0 and len(encodes) == 1  # never through the encoder again
    assert again.stats.image_tokens == image.n_tokens


def test_two_images_never_share_pages_the_same_one_does(rt: Any, encodes: list[int]) -> None:
    fresh(rt)
    a, b = vf.data_url(picture(700, 700, 22)), vf.data_url(picture(700, 700, 23))  # the same layout, other pixels
    run(rt.new_generator(), prepare(rt, [user(a, "Describe it.")]))
    other = prepare(rt, [user(b, "Describe it.")])
    assert other.prompt_ids == prepare(rt, [user(a, "Describe it.")]).prompt_ids  # token for token the same prompt
    _, done = run(rt.new_generator(), other)  # another conversation
    assert done.stats is not None
    first_slot = other.images[0].spans[0][0]
    assert done.stats.reused_tokens == first_slot  # the text before the image, not one of its slots
    assert len(encodes) == 2
    _, same = run(rt.new_generator(), prepare(rt, [user(a, "Describe it.")]))  # a third conversation, image a
    assert same.stats is not None and same.stats.reused_tokens > first_slot and same.stats.encode_ms == 0
