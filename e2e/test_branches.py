"""Branches: regenerate any reply, edit any question, ‹ n/m › versions, delete, Continue, a reply branched from one of
its tokens with another alternative, and a reply that keeps streaming while another chat is shown (tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage

pytestmark = pytest.mark.e2e

FIRST_TEXT_JS = "el => el.querySelector('[data-testid=token]').textContent"


def generates(chat: ChatPage) -> list[dict]:  # type: ignore[type-arg]
    return [f for f in chat.sent if f.get("type") == "generate"]


def test_branch_from_an_alternative_keeps_the_old_reply_one_click_away(chat: ChatPage, artifacts: Path) -> None:
    chat.page.get_by_test_id("heatmap-toggle").check()
    chat.set_settings(max_new_tokens="24", alternatives="8", temperature="0")
    chat.send("Branch me.")
    chat.wait_done()
    old_text = chat.reply_text()
    first = chat.last_reply().get_by_test_id("token").first
    first.click()
    popover = chat.page.get_by_test_id("popover")
    expect(popover).to_be_visible()
    picks = popover.get_by_test_id("alt-pick")
    assert picks.count() > 0, "expected alternatives to branch with"
    pick = picks.first
    alt_p = float(pick.locator("xpath=..").get_attribute("data-p") or "nan")
    top = chat.received_tokens()[0]["top"]
    alt = next(a for a in top if abs(a["p"] - alt_p) < 1e-12)
    chat.page.screenshot(path=str(artifacts / "branch-popover-desktop.png"))
    pick.click()
    chat.wait_done()
    req = generates(chat)[-1]
    assert req.get("continue") is True, f"expected a continue request, got {req}"
    assert req["messages"][-1] == {"role": "assistant", "content": alt["text"]}
    assert alt["id"] >= 0 and req.get("prefix_ids") == [alt["id"]], "the branch goes as the chosen token's id"
    new_id = chat.request_frames("done")[-1]["id"]
    assert chat.reply_text() == alt["text"] + chat.received_text(new_id)
    assert chat.last_reply().get_by_test_id("message-body").evaluate(FIRST_TEXT_JS) == alt["text"]
    expect(chat.last_reply().get_by_test_id("token").first).to_have_attribute("data-picked", "true")
    expect(chat.last_reply().get_by_test_id("version")).to_have_text("2/2")
    chat.page.screenshot(path=str(artifacts / "branch-done-desktop.png"))
    chat.last_reply().get_by_test_id("version-prev").click()
    assert chat.reply_text() == old_text
    expect(chat.last_reply().get_by_test_id("version")).to_have_text("1/2")


def test_continue_appends_to_the_last_reply(chat: ChatPage) -> None:
    chat.set_settings(max_new_tokens="12", alternatives="3")
    chat.send("Say something long.")
    chat.wait_done()
    assert chat.request_frames("done")[-1]["reason"] == "max_new_tokens"
    before = chat.reply_text()
    n_before = chat.last_reply().get_by_test_id("token").count()
    chat.last_reply().get_by_test_id("continue").click()
    chat.wait_done()
    req = generates(chat)[-1]
    assert req.get("continue") is True and req["messages"][-1] == {"role": "assistant", "content": before}
    first = chat.received_tokens(chat.request_frames("done")[-2]["id"])
    # the ids that spell the reply: up to its last token with text (a character cut off by the length limit leaves
    # text-less byte tokens at the end, which spell nothing), and none before it merged from several byte tokens
    spelled = first[: max((i + 1 for i, t in enumerate(first) if t["text"] != ""), default=0)]
    whole = bool(spelled) and all(t["text"] != "" for t in spelled)
    assert req.get("prefix_ids") == ([t["id"] for t in spelled] if whole else None)
    added = chat.received_text()
    assert added != "" and chat.reply_text() == before + added
    shown = [t for t in chat.received_tokens() if t["text"] != ""]
    assert chat.last_reply().get_by_test_id("token").count() == n_before + len(shown)
    expect(chat.page.get_by_test_id("assistant-message")).to_have_count(1)


def test_regenerate_an_earlier_reply_and_delete_messages(chat: ChatPage) -> None:
    chat.set_settings(max_new_tokens="8")
    chat.send("First")
    chat.wait_done()
    chat.send("Second")
    chat.wait_done()
    replies = chat.page.get_by_test_id("assistant-message")
    replies.first.get_by_test_id("regenerate").click()
    chat.wait_done()
    assert [m["content"] for m in generates(chat)[-1]["messages"]] == ["First"]
    expect(replies).to_have_count(1)  # the second turn followed the first version
    expect(replies.first.get_by_test_id("version")).to_have_text("2/2")
    replies.first.get_by_test_id("version-prev").click()
    expect(replies).to_have_count(2)
    expect(chat.page.get_by_test_id("user-message").get_by_test_id("message-body")).to_have_text(["First", "Second"])
    replies.last.get_by_test_id("delete").click()
    expect(replies).to_have_count(1)
    chat.page.get_by_test_id("user-message").last.get_by_test_id("delete").click()
    expect(chat.page.get_by_test_id("user-message")).to_have_count(1)
    chat.reload()
    chat.wait_connected()
    expect(chat.page.get_by_test_id("user-message").get_by_test_id("message-body")).to_have_text(["First"])
    expect(replies.first.get_by_test_id("version")).to_have_text("1/2")


def test_a_reply_keeps_streaming_while_another_chat_is_shown(chat: ChatPage, long_reply: str) -> None:
    chat.set_settings(max_new_tokens=long_reply)
    chat.send("Keep going in the background.")
    chat.wait_until("some text", lambda: len(chat.reply_text()) > 10)
    chat.page.get_by_test_id("new-chat").click()
    expect(chat.page.get_by_test_id("assistant-message")).to_have_count(0)
    expect(chat.page.get_by_test_id("send")).to_be_disabled()
    seen = len(chat.received_text())
    chat.wait_until("more text arrived in the background", lambda: len(chat.received_text()) > seen + 50)
    chat.page.get_by_test_id("conversation").filter(has_text="Keep going").get_by_role("button").first.click()
    expect(chat.last_reply()).to_have_attribute("data-state", "streaming")
    chat.wait_until("the view caught up", lambda: len(chat.reply_text()) > seen + 50)
    chat.stop_and_wait()
    assert chat.reply_text() == chat.received_text()
