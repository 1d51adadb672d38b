"""Keyboard only: type and send with Enter, stop with Escape, reach the heatmap and its popover with Tab and arrows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage

pytestmark = pytest.mark.e2e

FOCUSED_TESTID = "() => document.activeElement && document.activeElement.dataset.testid || ''"
FOCUSED_INDEX = "() => [...document.querySelectorAll('[data-testid=token]')].indexOf(document.activeElement)"


def visible(text: str) -> str:
    """How the popover shows a token: whitespace made visible (static/heatmap.js visibleToken)."""
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥") if text else "∅"


def tab_to(chat: ChatPage, testid: str, key: str = "Tab", limit: int = 60) -> int:
    """Press `key` until the focused element has data-testid `testid`; returns how many presses it took."""
    for presses in range(1, limit + 1):
        chat.page.keyboard.press(key)
        if chat.page.evaluate(FOCUSED_TESTID) == testid:
            return presses
    raise AssertionError(f"{limit} presses of {key} never focused [data-testid={testid}]")


def test_keyboard_send_stop_and_popover(chat: ChatPage, long_reply: str) -> None:
    page = chat.page
    assert page.evaluate(FOCUSED_TESTID) == "input", "the input should have focus when the page opens"
    # settings by keyboard: open the panel, type a value, close with Escape
    tab_to(chat, "settings-open", key="Shift+Tab")
    page.keyboard.press("Enter")
    expect(page.get_by_test_id("settings-panel")).to_be_visible()
    tab_to(chat, "setting-max_new_tokens")
    page.keyboard.press("Control+A")
    page.keyboard.type(long_reply)
    page.keyboard.press("Escape")
    expect(page.get_by_test_id("settings-panel")).to_be_hidden()

    tab_to(chat, "input")
    page.keyboard.type("First line")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("second line")
    expect(page.get_by_test_id("input")).to_have_value("First line\nsecond line")
    page.keyboard.press("Enter")
    expect(chat.last_reply()).to_have_attribute("data-state", "streaming")
    tokens = chat.last_reply().get_by_test_id("token")
    chat.wait_until("a few tokens arrived (the arrow keys need two)", lambda: tokens.count() >= 3)
    page.keyboard.press("Escape")
    chat.wait_done(timeout_ms=5_000)
    assert chat.request_frames("done")[-1]["reason"] == "cancelled"
    expect(chat.last_reply()).to_have_attribute("data-reason", "cancelled")
    expect(page.get_by_test_id("user-message").get_by_test_id("message-body")).to_have_text("First line\nsecond line")

    # heatmap on by keyboard, then Tab into the reply: one tab stop, the popover opens on focus
    tab_to(chat, "heatmap-toggle", key="Shift+Tab")
    page.keyboard.press("Space")
    expect(page.get_by_test_id("heatmap-toggle")).to_be_checked()
    tab_to(chat, "token")
    popover = page.get_by_test_id("popover")
    expect(popover).to_be_visible()
    spans = chat.last_reply().get_by_test_id("token")
    expect(popover.get_by_test_id("popover-token")).to_have_text(visible(spans.nth(0).text_content() or ""))
    expect(popover.get_by_test_id("alt")).not_to_have_count(0)
    page.keyboard.press("ArrowRight")
    assert page.evaluate(FOCUSED_INDEX) == 1, "ArrowRight should move the focus to the next token"
    expect(popover).to_be_visible()
    expect(popover.get_by_test_id("popover-token")).to_have_text(visible(spans.nth(1).text_content() or ""))
    page.keyboard.press("Escape")
    expect(popover).to_be_hidden()
