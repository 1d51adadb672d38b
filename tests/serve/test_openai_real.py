"""Truth on the real default model: the API's greedy text and logprobs are the websocket's, speculative included."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from live_server import Live, serve  # tests/ is on sys.path under pytest
from test_openai_live import PROMPT, assert_logprobs_match, openai_client, websocket_reply

from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]
TOKENS = 24


@pytest.fixture(scope="module")
def runtime(real_model_dir: Path) -> Runtime:
    return load_runtime(ServerConfig(model_dir=real_model_dir, device="cpu", max_seq_len=512))


@pytest.fixture(scope="module")
def live(runtime: Runtime, real_model_dir: Path) -> Iterator[Live]:
    with serve(ServerConfig(model_dir=real_model_dir, device="cpu", max_seq_len=512), runtime) as server:
        yield server


@pytest.fixture(scope="module")
def reference(live: Live) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """What the websocket answers, greedy with 5 alternatives per token."""
    return websocket_reply(live.url, PROMPT, TOKENS, alternatives=5)


@pytest.mark.parametrize("speculative", ["none", "self", "ngram", "auto"])
def test_greedy_chat_equals_the_websocket(live: Live, runtime: Runtime, speculative: str,
                                         reference: tuple[str, list[dict[str, Any]], dict[str, Any]]) -> None:
    """Same mode: the same numbers. Across modes the text is the same; a verify forward's logits differ in the last
    float32 bits from single-token decoding, so probabilities agree to about 1e-5 there."""
    plain_text, plain_tokens, _ = reference
    want_text, ws_tokens, done = websocket_reply(live.url, PROMPT, TOKENS, alternatives=5, speculative=speculative)
    assert want_text == plain_text and len(want_text) > 20
    reply = openai_client(live).chat.completions.create(
        model=runtime.model_name, messages=PROMPT, temperature=0, max_tokens=TOKENS,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=5, extra_body={"speculative": speculative})
    choice = reply.choices[0]
    assert choice.message.content == want_text
    assert choice.finish_reason == ("length" if done["reason"] == "max_new_tokens" else "stop")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert_logprobs_match(choice.logprobs.content, ws_tokens, want_text)
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(
        [math.log(t["p"]) for t in plain_tokens], abs=1e-4)


def test_streamed_chat_equals_the_websocket(live: Live, runtime: Runtime,
                                           reference: tuple[str, list[dict[str, Any]], dict[str, Any]]) -> None:
    want_text, ws_tokens, _ = reference
    chunks = list(openai_client(live).chat.completions.create(
        model=runtime.model_name, messages=PROMPT, temperature=0, max_tokens=TOKENS,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=5, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_text
    content = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert_logprobs_match(content, ws_tokens, want_text)
