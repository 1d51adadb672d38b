"""The model picker (issue 22): a server with two tiny models; pick one, chat, regenerate the reply on the other
(loading progress, the reply names its model, the option shows it loaded), reload: the chat still names its model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_models(launch_tiny: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from bench.tiny import make_tiny_model

    shelf = tmp_path_factory.mktemp("shelf")
    make_tiny_model(shelf / "tiny-b", seed=1, max_seq_len=1024)
    server = launch_tiny("--models-dir", str(shelf))
    yield server
    server.stop()


def test_pick_a_model_chat_switch_and_reload(two_models: Server, new_page: Callable[..., ChatPage],
                                             artifacts: Path) -> None:  # fmt: skip
    chat = new_page(two_models)
    picker = chat.page.get_by_test_id("model-picker")
    expect(picker).to_be_visible()
    options = picker.locator("option")
    expect(options).to_have_count(2)
    default = options.nth(0).get_attribute("value") or ""
    assert options.nth(0).get_attribute("data-loaded") == "true"
    expect(options.nth(1)).to_have_text("tiny-b · Llama · float32 · 0.5 MB · not loaded")
    assert picker.input_value() == default
    chat.set_settings(max_new_tokens="16", temperature="0")
    chat.send("Which model are you?")
    chat.wait_done()
    first = chat.reply_text()
    gen = [f for f in chat.sent if f.get("type") == "generate"]
    assert gen[-1]["model"] == default
    expect(chat.last_reply().get_by_test_id("reply-model")).to_have_text(default)

    picker.select_option("tiny-b")
    expect(chat.page.locator("#model-info")).to_contain_text("not loaded")
    chat.last_reply().get_by_test_id("regenerate").click()
    chat.wait_done()
    gen = [f for f in chat.sent if f.get("type") == "generate"]
    assert gen[-1]["model"] == "tiny-b"
    loading = chat.request_frames("loading")
    assert [m["state"] for m in loading] == ["loading", "loaded"] and loading[-1]["model"] == "tiny-b"
    second = chat.reply_text()
    assert second != first, "two models with different weights wrote the same reply"
    expect(chat.last_reply().get_by_test_id("reply-model")).to_have_text("tiny-b")
    expect(chat.last_reply().get_by_test_id("version")).to_have_text("2/2")
    assert options.nth(1).get_attribute("data-loaded") == "true"
    expect(chat.page.locator("#model-info")).to_have_text("context 1024 · loaded")
    expect(options.nth(1)).to_have_text("tiny-b · Llama · float32 · 0.5 MB")
    chat.page.screenshot(path=str(artifacts / "model-picker.png"))

    chat.reload()
    chat.wait_connected()
    expect(chat.page.get_by_test_id("model-picker")).to_have_value("tiny-b")  # the chat remembers its model
    expect(chat.last_reply().get_by_test_id("reply-model")).to_have_text("tiny-b")
    chat.last_reply().get_by_test_id("version-prev").click()
    expect(chat.last_reply().get_by_test_id("reply-model")).to_have_text(default)
    assert chat.reply_text() == first

    chat.page.get_by_test_id("new-chat").click()  # a new chat keeps the picked model
    chat.send("And now?")
    chat.wait_done()
    assert [f for f in chat.sent if f.get("type") == "generate"][-1]["model"] == "tiny-b"
