"""The chat page as a person uses it: streaming, Stop, reload, two tabs, an over-long prompt (tiny model)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = pytest.mark.e2e


def test_reply_streams_in_and_send_becomes_stop(chat: ChatPage, long_reply: str) -> None:
    chat.set_settings(max_new_tokens=long_reply, seed="1")
    chat.send("Tell me a long story.")
    expect(chat.page.get_by_test_id("stop")).to_be_visible()
    expect(chat.page.get_by_test_id("send")).to_be_hidden()
    lengths = chat.observe_growth()
    assert len(lengths) >= 3, f"expected the reply to grow over at least 3 observations, saw lengths {lengths}"
    chat.stop_and_wait()
    expect(chat.page.get_by_test_id("send")).to_be_visible()
    assert chat.reply_text() == chat.received_text()
    user = chat.page.get_by_test_id("user-message").last.get_by_test_id("message-body")
    expect(user).to_have_text("Tell me a long story.")


def test_a_finished_reply_shows_its_stats(chat: ChatPage) -> None:
    chat.set_settings(max_new_tokens="50")
    chat.send("A short one.")
    chat.wait_done()
    done = chat.request_frames("done")[-1]
    assert done["reason"] == "max_new_tokens", f"expected the tiny model to run to the limit, got {done}"
    assert chat.reply_text() == chat.received_text()
    status = chat.last_reply().get_by_test_id("reply-status").text_content() or ""
    stats = done["stats"]
    for part in (f"first token {round(stats['ttft_ms'])} ms", f"{stats['decode_tps']:.1f} tok/s", "50 tokens"):
        assert part in status, f"expected {part!r} in the reply's status line, got {status!r}"
    expect(chat.last_reply().get_by_test_id("stopped")).to_have_count(0)


def test_stop_ends_the_stream_and_keeps_the_text(chat: ChatPage, long_reply: str) -> None:
    chat.set_settings(max_new_tokens=long_reply, seed="2")
    chat.send("Tell me a long story.")
    expect(chat.last_reply()).to_have_attribute("data-state", "streaming")
    chat.wait_until("the reply has some text", lambda: len(chat.reply_text()) > 20)
    t0 = time.monotonic()
    chat.page.get_by_test_id("stop").click()
    chat.wait_done(timeout_ms=5_000)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0, f"expected Stop to end the stream within 1 s, took {elapsed:.2f} s"
    done = chat.request_frames("done")[-1]
    assert done["reason"] == "cancelled", f"expected the server to report the request cancelled, got {done}"
    assert done["stats"]["new_tokens"] < int(long_reply)
    expect(chat.last_reply()).to_have_attribute("data-reason", "cancelled")
    expect(chat.last_reply().get_by_test_id("stopped")).to_have_text("stopped")
    kept = chat.reply_text()
    assert kept != "" and kept == chat.received_text()
    chat.page.wait_for_timeout(500)
    assert chat.reply_text() == kept, "the text grew after Stop"
    expect(chat.page.get_by_test_id("send")).to_be_visible()


def test_escape_stops_too(chat: ChatPage, long_reply: str) -> None:
    chat.set_settings(max_new_tokens=long_reply)
    chat.send("Go on and on.")
    expect(chat.last_reply()).to_have_attribute("data-state", "streaming")
    chat.page.keyboard.press("Escape")
    chat.wait_done(timeout_ms=5_000)
    assert chat.request_frames("done")[-1]["reason"] == "cancelled"


def test_reload_restores_the_conversation(chat: ChatPage) -> None:
    chat.set_settings(max_new_tokens="40", temperature="0")
    chat.send("First question")
    chat.wait_done()
    first = chat.reply_text()
    chat.send("Second question")
    chat.wait_done()
    second = chat.reply_text()
    chat.reload()
    chat.wait_connected()
    bodies = chat.page.get_by_test_id("messages").get_by_test_id("message-body")
    expect(bodies).to_have_count(4)
    assert [bodies.nth(i).text_content() for i in range(4)] == ["First question", first, "Second question", second]
    expect(chat.page.get_by_test_id("setting-max_new_tokens")).to_have_value("40")
    # a new chat, then back to the first one through the sidebar
    chat.page.get_by_test_id("new-chat").click()
    expect(bodies).to_have_count(0)
    chat.page.get_by_test_id("conversation").filter(has_text="First question").get_by_role("button").first.click()
    expect(bodies).to_have_count(4)


def test_two_pages_stream_at_once(tiny_server: Server, new_page: Callable[..., ChatPage], long_reply: str) -> None:
    a, b = new_page(tiny_server), new_page(tiny_server)
    for chat in (a, b):
        chat.set_settings(max_new_tokens=long_reply)
    a.send("Page A speaks.")
    b.send("Page B speaks.")
    grew = {"a": [0], "b": [0]}
    both_streaming = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and min(len(grew["a"]), len(grew["b"])) < 8:
        states = []
        for name, chat in (("a", a), ("b", b)):
            n, state = len(chat.reply_text()), chat.reply_state()
            states.append(state)
            if state == "streaming" and n > grew[name][-1]:
                grew[name].append(n)
        both_streaming += states == ["streaming", "streaming"]
        a.page.wait_for_timeout(10)
    assert len(grew["a"]) > 3 and len(grew["b"]) > 3, f"reply lengths seen growing: {grew}"
    assert both_streaming >= 2, f"the two replies were seen streaming at the same time only {both_streaming} times"
    for chat in (a, b):
        chat.stop_and_wait()
        assert chat.reply_text() == chat.received_text()


def test_prompt_over_the_context_shows_the_error_and_keeps_the_text(chat: ChatPage) -> None:
    # the tiny model's context is 8192 and this one message is ~8400 tokens: older messages could be left out to fit,
    # the latest one cannot (a prompt that fits but leaves less than max_new_tokens runs and ends at context_full)
    chat.set_settings(max_new_tokens="20")
    typed = "Please summarise all of this: " + "lorem ipsum dolor sit amet " * 400
    chat.send(typed)
    error = chat.page.get_by_test_id("error")
    expect(error).to_be_visible()
    server_error = chat.request_frames("error")[-1]
    assert server_error["code"] == "prompt_too_long"
    expect(error).to_contain_text(server_error["message"])
    expect(chat.page.get_by_test_id("input")).to_have_value(typed)
    expect(chat.page.get_by_test_id("assistant-message")).to_have_count(0)
    expect(chat.page.get_by_test_id("user-message")).to_have_count(0)
    # shortening the message and sending again works, and the error goes away
    chat.page.get_by_test_id("input").fill("Please summarise all of this: " + "lorem ipsum dolor sit amet " * 30)
    chat.page.get_by_test_id("input").press("Enter")
    chat.wait_done()
    expect(error).to_have_count(0)
    expect(chat.page.get_by_test_id("input")).to_have_value("")


def test_invalid_setting_is_flagged_next_to_the_field_and_blocks_sending(chat: ChatPage) -> None:
    chat.page.get_by_test_id("settings-open").click()
    chat.page.get_by_test_id("setting-top_p").fill("1.5")
    expect(chat.page.get_by_test_id("setting-error-top_p")).to_contain_text("1.5")
    chat.page.get_by_test_id("settings-close").click()
    chat.send("hello")
    expect(chat.page.get_by_test_id("error")).to_contain_text("Top-p")
    expect(chat.page.get_by_test_id("input")).to_have_value("hello")
    assert chat.request_frames("chunk") == []


def test_regenerate_and_edit_keep_the_old_versions(chat: ChatPage) -> None:
    chat.set_settings(max_new_tokens="30")
    chat.send("Original question")
    chat.wait_done()
    first_text = chat.reply_text()
    chat.last_reply().get_by_test_id("regenerate").click()
    chat.wait_done()
    expect(chat.page.get_by_test_id("assistant-message")).to_have_count(1)
    first_id, second_id = (f["id"] for f in chat.request_frames("done"))
    assert first_id != second_id
    assert chat.reply_text() == chat.received_text(second_id)
    expect(chat.last_reply().get_by_test_id("version")).to_have_text("2/2")
    chat.last_reply().get_by_test_id("version-prev").click()
    expect(chat.last_reply().get_by_test_id("version")).to_have_text("1/2")
    assert chat.reply_text() == first_text == chat.received_text(first_id)
    user = chat.page.get_by_test_id("user-message").last
    user.get_by_test_id("edit").click()
    expect(user.get_by_test_id("edit-input")).to_have_value("Original question")
    user.get_by_test_id("edit-input").fill("Edited question")
    user.get_by_test_id("edit-save").click()
    chat.wait_done()
    user = chat.page.get_by_test_id("user-message")
    expect(user.get_by_test_id("message-body")).to_have_text(["Edited question"])
    expect(user.get_by_test_id("version")).to_have_text("2/2")
    user.get_by_test_id("version-prev").click()
    expect(user.get_by_test_id("message-body")).to_have_text(["Original question"])
    expect(chat.last_reply().get_by_test_id("version")).to_have_text("1/2")  # the old question keeps its replies


def test_speculative_reply_shows_its_acceptance_rate(chat: ChatPage) -> None:
    if chat.server.engine == "remote":
        pytest.skip("speculative modes are the local engine's; a remote engine offers only none")
    chat.page.get_by_test_id("settings-open").click()
    modes = chat.page.get_by_test_id("setting-speculative").locator("option").all_text_contents()
    assert "ngram" in modes, f"expected the server's hello to offer ngram, got {modes}"
    chat.page.get_by_test_id("setting-speculative").select_option("ngram")
    chat.set_settings(max_new_tokens="200", temperature="0")
    chat.send("Repeat after me: the cat sat on the mat, the cat sat on the mat.")
    chat.wait_done()
    stats = chat.request_frames("done")[-1]["stats"]
    assert stats["drafted"] > 0, f"expected ngram drafting to propose tokens, got {stats}"
    rate = round(100 * stats["accepted"] / stats["drafted"])
    expect(chat.last_reply().get_by_test_id("reply-status")).to_contain_text(
        f"drafted {stats['drafted']}, accepted {stats['accepted']} ({rate}%)"
    )
