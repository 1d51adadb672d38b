"""The page on the real default model (SmolLM2-135M-Instruct): a true answer streams in with its heatmap; screenshots
of both themes mid-stream go to artifacts/."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = [pytest.mark.e2e, pytest.mark.real_model]

QUESTION = "What is the capital of France? Answer, then describe the city in a few sentences."
# the stopped run needs a reply long enough to still stream when Stop is clicked: the quantized model is fast
LONG_QUESTION = "Write a long story, at least five paragraphs, about a day in Paris."


def start_with_heatmap(chat: ChatPage, question: str, max_new_tokens: int) -> None:
    chat.page.get_by_test_id("heatmap-toggle").check()
    chat.set_settings(temperature="0", max_new_tokens=str(max_new_tokens), alternatives="5")
    chat.send(question)
    tokens = chat.last_reply().get_by_test_id("token")
    chat.wait_until("a dozen tokens streamed in", lambda: tokens.count() >= 12, timeout_s=120)
    assert chat.reply_state() == "streaming", "the reply ended before the mid-stream screenshot"
    tokens.nth(6).hover()
    expect(chat.page.get_by_test_id("popover")).to_be_visible()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_real_model_streams_a_true_answer_with_its_heatmap(
    scheme: str, real_server: Server, new_page: Callable[..., ChatPage], artifacts: Path
) -> None:
    chat = new_page(real_server, color_scheme=scheme)
    expect(chat.page.get_by_test_id("model-name")).to_have_text("SmolLM2-135M-Instruct")
    # the default runs the 4-bit blocks, with int8x2 activations on a vector path (a 135M model; docs/quant.md)
    expect(chat.page.locator("#model-info")).to_contain_text("q4_1 weights · int8x2 activations")
    expect(chat.page.locator("#model-info")).to_have_attribute("data-precision", "int8x2")
    info = chat.page.locator("#model-info")  # a narrow header cuts it with an ellipsis: its title holds it whole
    assert info.get_attribute("title").startswith(info.text_content() + "\n"), info.get_attribute("title")
    if scheme == "dark":  # the light run checks the whole answer; this one stops mid-stream
        start_with_heatmap(chat, LONG_QUESTION, 500)
    else:
        start_with_heatmap(chat, QUESTION, 60)
    shot = artifacts / f"e2e-midstream-heatmap-{scheme}.png"
    chat.page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    if scheme == "dark":
        chat.page.get_by_test_id("stop").click()
        chat.wait_done(timeout_ms=5_000)
        assert chat.request_frames("done")[-1]["reason"] == "cancelled"
        return
    chat.wait_done(timeout_ms=120_000)
    text = chat.reply_text()
    assert "Paris" in text, f"expected the greedy answer to name Paris, got {text!r}"
    assert text == chat.received_text()
    spans = chat.last_reply().get_by_test_id("token")
    assert spans.count() == len([t for t in chat.received_tokens() if t["text"] != ""])
    done = chat.request_frames("done")[-1]
    assert done["reason"] == "stop_token", done
    status = chat.last_reply().get_by_test_id("reply-status").text_content() or ""
    assert f"{done['stats']['new_tokens']} tokens" in status, status
