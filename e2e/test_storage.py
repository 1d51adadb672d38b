"""Storage and portability: IndexedDB with a one-time move from localStorage, rename, search, and export then import
into a fresh browser profile giving the same chats, heatmaps included (tiny model)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = pytest.mark.e2e

MESSAGES_JS = """() => [...document.querySelectorAll('[data-testid$=-message]')].map(m => ({
  role: m.dataset.testid, text: m.querySelector('[data-testid=message-body]').textContent,
  ps: [...m.querySelectorAll('[data-testid=token]')].map(s => Number(s.dataset.p)),
  version: m.querySelector('[data-testid=version]')?.textContent ?? null}))"""
OLD_TOKENS = [{"id": 1, "text": "Old", "p": 0.5, "rank": 1, "top": [{"id": 1, "text": "Old", "p": 0.5}]},
              {"id": 2, "text": " reply", "p": 0.25, "rank": 2, "top": [{"id": 3, "text": "!", "p": 0.6},
                                                                       {"id": 2, "text": " reply", "p": 0.25}]}]
OLD = [{"id": "legacy1", "title": "Legacy chat", "created": 1, "updated": 2, "messages": [
    {"role": "user", "content": "An old question"},
    {"role": "assistant", "content": "Old reply", "tokens": OLD_TOKENS, "reason": "stop_token"}]}]


def snapshot(chat: ChatPage) -> list[dict[str, Any]]:
    """Every conversation in the sidebar, opened in turn: title and messages (text, token probabilities)."""
    out = []
    items = chat.page.get_by_test_id("conversation")
    for i in range(items.count()):
        item = items.nth(i)
        title = item.get_by_role("button").first.text_content()
        item.get_by_role("button").first.click()
        chat.page.wait_for_timeout(50)
        out.append({"title": title, "messages": chat.page.evaluate(MESSAGES_JS)})
    return out


def test_localstorage_chats_move_to_indexeddb_once(chat: ChatPage) -> None:
    chat.page.evaluate("(v) => localStorage.setItem('webchat.conversations.v1', v)", json.dumps(OLD))
    chat.reload()
    chat.wait_connected()
    chat.page.get_by_test_id("conversation").filter(has_text="An old question").get_by_role("button").first.click()
    chat.page.get_by_test_id("heatmap-toggle").check()
    got = chat.page.evaluate(MESSAGES_JS)
    assert [(m["role"], m["text"]) for m in got] == [("user-message", "An old question"),
                                                      ("assistant-message", "Old reply")]
    assert got[1]["ps"] == [0.5, 0.25], "the heatmap data did not survive the move"
    assert chat.page.evaluate("localStorage.getItem('webchat.conversations.v1')") is None
    chat.reload()
    chat.wait_connected()
    expect(chat.page.get_by_test_id("conversation").filter(has_text="An old question")).to_have_count(1)


def test_rename_and_search(chat: ChatPage) -> None:
    chat.set_settings(max_new_tokens="6")
    chat.send("alpha question")
    chat.wait_done()
    chat.page.get_by_test_id("new-chat").click()
    chat.send("beta question")
    chat.wait_done()
    item = chat.page.get_by_test_id("conversation").filter(has_text="alpha question")
    item.hover()  # the item's buttons show on hover or keyboard focus
    item.get_by_test_id("conversation-rename").click()
    chat.page.get_by_test_id("rename-input").fill("My renamed chat")
    chat.page.get_by_test_id("rename-input").press("Enter")
    expect(chat.page.get_by_test_id("conversation").filter(has_text="My renamed chat")).to_have_count(1)
    chat.page.get_by_test_id("search").fill("renamed")
    expect(chat.page.get_by_test_id("conversation")).to_have_count(1)
    chat.page.get_by_test_id("search").fill("beta QUESTION")  # message text, any case
    expect(chat.page.get_by_test_id("conversation")).to_have_count(1)
    expect(chat.page.get_by_test_id("conversation").first).to_contain_text("beta question")
    chat.page.get_by_test_id("search").fill("")
    # the page counts its IndexedDB writes in flight (chat.reload waits for none): after these, all committed
    expect(chat.page.locator("body[data-saving='0']")).to_have_count(1)
    chat.reload()
    chat.wait_connected()
    expect(chat.page.get_by_test_id("conversation").filter(has_text="My renamed chat")).to_have_count(1)


def test_export_then_import_into_a_fresh_profile(tiny_server: Server, new_page: Callable[..., ChatPage],
                                                 tmp_path: Path) -> None:
    a = new_page(tiny_server, accept_downloads=True)
    a.page.get_by_test_id("heatmap-toggle").check()
    a.set_settings(max_new_tokens="10", alternatives="4")
    a.send("first chat")
    a.wait_done()
    a.last_reply().get_by_test_id("regenerate").click()  # a second version must travel too
    a.wait_done()
    a.page.get_by_test_id("new-chat").click()
    a.send("second chat")
    a.wait_done()
    with a.page.expect_download() as info:
        a.page.get_by_test_id("export-all").click()
    path = tmp_path / "export.json"
    info.value.save_as(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "webchat-conversations" and len(doc["conversations"]) == 2
    before = snapshot(a)
    b = new_page(tiny_server)
    assert b.page.get_by_test_id("assistant-message").count() == 0
    b.page.get_by_test_id("import-file").set_input_files(str(path))
    expect(b.page.get_by_test_id("import-status")).to_have_text("Imported 2 conversations")
    b.page.get_by_test_id("heatmap-toggle").check()
    after = [c for c in snapshot(b) if c["messages"]]
    assert after == before
    assert all(m["ps"] for c in after for m in c["messages"] if m["role"] == "assistant-message")
    assert any(m["version"] == "2/2" for c in after for m in c["messages"])
