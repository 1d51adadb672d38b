"""Status as a person sees it: the queue position while waiting for the one slot, and reconnecting after a restart."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def one_slot_server(launch_tiny: Callable[..., Server]) -> Iterator[Server]:
    server = launch_tiny("--max-sessions", "1")
    yield server
    server.stop()


def test_a_waiting_request_shows_its_queue_position(
    one_slot_server: Server, new_page: Callable[..., ChatPage], long_reply: str
) -> None:
    a, b = new_page(one_slot_server), new_page(one_slot_server)
    for chat in (a, b):
        chat.set_settings(max_new_tokens=long_reply)
    a.send("I take the only slot.")
    expect(a.last_reply()).to_have_attribute("data-state", "streaming")
    b.send("I wait.")
    expect(b.last_reply()).to_have_attribute("data-state", "queued")
    expect(b.last_reply().get_by_test_id("reply-status")).to_have_text("waiting in queue: position 1")
    expect(b.page.get_by_test_id("activity")).to_have_text("Waiting in queue: position 1")
    assert b.request_frames("queued")[-1]["position"] == 1
    a.stop_and_wait()
    expect(b.last_reply()).to_have_attribute("data-state", "streaming", timeout=10_000)
    b.stop_and_wait()
    assert b.reply_text() == b.received_text() != ""


def test_the_page_reconnects_after_a_server_restart(
    one_slot_server: Server, new_page: Callable[..., ChatPage], launch_tiny: Callable[..., Server]
) -> None:
    chat = new_page(one_slot_server)
    chat.page.get_by_test_id("input").fill("typed while the server is away")
    one_slot_server.stop()
    status = chat.page.get_by_test_id("status")
    expect(status).to_have_attribute("data-state", "reconnecting")
    expect(status).to_have_text(re.compile(r"reconnecting|connecting"))
    chat.page.get_by_test_id("input").press("Enter")
    expect(chat.page.get_by_test_id("input")).to_have_value("typed while the server is away")
    port = int(one_slot_server.url.rsplit(":", 1)[1].strip("/"))
    again = launch_tiny("--max-sessions", "1", port=port)
    chat.server = again
    try:
        expect(status).to_have_attribute("data-state", "open", timeout=20_000)
        chat.set_settings(max_new_tokens="20")
        chat.page.get_by_test_id("input").press("Enter")
        chat.wait_done()
        expect(chat.page.get_by_test_id("input")).to_have_value("")
        expect(chat.page.get_by_test_id("user-message").get_by_test_id("message-body")).to_have_text(
            "typed while the server is away"
        )
    finally:
        again.stop()
    # the browser itself logs each refused attempt while the server was away: expected here, and only that
    chat.errors = [e for e in chat.errors if "ERR_CONNECTION_REFUSED" not in e]
