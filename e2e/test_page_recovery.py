"""Issue 12 in the browser: a chat template that raises leaves the page usable; a long chat says what was trimmed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from page_driver import start_server
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def overflow_server(e2e_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("overflow") / "model"
    shutil.copytree(e2e_tiny_model_dir, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% set n = range(10**20) | length %}{{ n }}"  # OverflowError inside the sandbox
    cfg_path.write_text(json.dumps(cfg))
    server = start_server(folder, folder.parent / "serve.log")
    yield server
    server.stop()


def test_a_template_that_raises_leaves_the_page_usable(overflow_server: Server,
                                                       new_page: Callable[..., ChatPage]) -> None:
    chat = new_page(overflow_server)
    page = chat.page
    for attempt in ("first try", "second try"):
        chat.send(attempt)
        expect(page.get_by_test_id("error")).to_contain_text("OverflowError")
        expect(page.get_by_test_id("send")).to_be_visible()
        expect(page.get_by_test_id("send")).to_be_enabled()
        expect(page.get_by_test_id("stop")).to_be_hidden()
        expect(page.get_by_test_id("input")).to_have_value(attempt)  # the typed text comes back
        errors = chat.request_frames("error")
        assert errors[-1]["id"] == chat.last_request_id(), errors  # tied to its request, never id null
    page.get_by_test_id("new-chat").click()
    expect(page.get_by_test_id("assistant-message")).to_have_count(0)


@pytest.fixture(scope="module")
def small_context_server(launch_tiny: Callable[..., Server]) -> Iterator[Server]:
    server = launch_tiny("--max-seq-len", "256")
    yield server
    server.stop()


def test_a_long_chat_keeps_answering_and_says_what_was_left_out(small_context_server: Server,
                                                                new_page: Callable[..., ChatPage]) -> None:
    chat = new_page(small_context_server)
    for turn in range(4):
        chat.send(f"turn {turn}: " + "tell me about the sea " * 8)
        chat.wait_done()
        assert chat.request_frames("done")[-1]["id"] == chat.last_request_id()
    generates = chat.request_frames("start")
    assert any(s.get("trimmed_messages", 0) > 0 for s in generates), generates
    expect(chat.page.get_by_test_id("activity")).to_contain_text("left out to fit the model's context")
    expect(chat.page.get_by_test_id("error")).to_have_count(0)
