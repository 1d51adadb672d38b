"""The probability heatmap: one coloured span per token, their text the reply, a popover of sorted alternatives."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = pytest.mark.e2e

# one entry per token: its primary span, with the text of the continuation spans that follow it (a token whose text
# crosses a Markdown element boundary, e.g. the end of a list item, continues in a span of class tok-cont)
SPANS_JS = """() => {
  const out = [];
  for (const s of document.querySelectorAll('[data-testid=assistant-message]:last-of-type .tok')) {
    if (s.classList.contains('tok-cont')) { out[out.length - 1].text += s.textContent; continue; }
    out.push({text: s.textContent, p: Number(s.dataset.p), parts: Number(s.dataset.parts || 1),
              bg: getComputedStyle(s).backgroundColor});
  }
  return out;
}"""
EXPECTED_COLOURS_JS = """async (ps) => {
  const m = await import('/static/heatmap.js');
  return ps.map(p => m.probColor(p));
}"""


def spans(chat: ChatPage) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = chat.page.evaluate(SPANS_JS)
    return result


def percentages(chat: ChatPage) -> list[float]:
    texts = chat.page.get_by_test_id("popover").get_by_test_id("alt-pct").all_text_contents()
    values = []
    for t in texts:
        m = re.fullmatch(r"(<)?(\d+(?:\.\d+)?)%", t)
        assert m, f"expected a percentage like '12.5%', got {t!r}"
        values.append(float(m.group(2)))
    return values


def test_every_token_is_one_coloured_span_live_and_after(chat: ChatPage, long_reply: str) -> None:
    chat.page.get_by_test_id("heatmap-toggle").check()
    expect(chat.page.get_by_test_id("legend")).to_be_visible()
    chat.set_settings(max_new_tokens=long_reply, alternatives="5")
    chat.send("Colour me.")
    chat.wait_until("some tokens arrived", lambda: chat.last_reply().get_by_test_id("token").count() > 5)
    assert chat.reply_state() == "streaming", "the reply ended before its colours could be checked live"
    live = spans(chat)
    assert all(s["bg"] not in ("", "rgba(0, 0, 0, 0)", "transparent") for s in live), "an uncoloured token mid-stream"
    chat.wait_until("a few hundred tokens arrived", lambda: chat.last_reply().get_by_test_id("token").count() > 300)
    chat.stop_and_wait()
    got = spans(chat)
    tokens = chat.received_tokens()
    shown = [t for t in tokens if t["text"] != ""]
    assert len(tokens) == chat.request_frames("done")[-1]["stats"]["new_tokens"]
    # pieces "" belong to the token that completes their character: one span per completed character or token
    assert len(got) == len(shown), f"{len(got)} spans for {len(shown)} tokens with text ({len(tokens)} in all)"
    # a reply stopped mid-character ends with pieces "" that nothing completed: they have no text, hence no span
    dangling = len(tokens) - max((i + 1 for i, t in enumerate(tokens) if t["text"] != ""), default=0)
    assert sum(s["parts"] for s in got) == len(tokens) - dangling
    assert "".join(s["text"] for s in got) == chat.reply_text() == chat.received_text()
    assert [s["text"] for s in got] == [t["text"] for t in shown]
    single = [(s, t) for s, t in zip(got, shown, strict=True) if s["parts"] == 1]
    assert all(abs(s["p"] - t["p"]) < 1e-9 for s, t in single)
    colours = chat.page.evaluate(EXPECTED_COLOURS_JS, [s["p"] for s in got])
    assert [s["bg"] for s in got] == colours, "a span's colour is not probColor(p) of its probability"
    assert len(set(colours)) > 5, "expected the tokens to differ in colour"


def test_heatmap_off_leaves_text_plain_and_modes_recolour(chat: ChatPage) -> None:
    chat.set_settings(max_new_tokens="60")
    chat.send("Plain text please.")
    chat.wait_done()
    assert {s["bg"] for s in spans(chat)} == {"rgba(0, 0, 0, 0)"}, "tokens coloured with the heatmap off"
    toggle = chat.page.get_by_test_id("heatmap-toggle")
    toggle.check()
    by_prob = [s["bg"] for s in spans(chat)]
    chat.page.get_by_test_id("heatmap-mode").select_option("rank")
    expect(chat.page.get_by_test_id("legend")).to_contain_text("Rank")
    by_rank = [s["bg"] for s in spans(chat)]
    chat.page.get_by_test_id("heatmap-mode").select_option("entropy")
    expect(chat.page.get_by_test_id("legend")).to_contain_text("Entropy")
    by_entropy = [s["bg"] for s in spans(chat)]
    assert by_prob != by_rank and by_prob != by_entropy and by_rank != by_entropy


def test_hover_shows_sorted_alternatives_with_percentages(chat: ChatPage) -> None:
    chat.page.get_by_test_id("heatmap-toggle").check()
    chat.set_settings(max_new_tokens="80", alternatives="8")
    chat.send("Hover over me.")
    chat.wait_done()
    popover = chat.page.get_by_test_id("popover")
    tokens = chat.last_reply().get_by_test_id("token")
    for i in (0, 3, 7):
        # away first, as a user goes round it: the open popover may cover the next token (the pointer can travel
        # into it, to the alternatives), and which token it covers depends on how the reply's lines wrap
        chat.page.mouse.move(5, 790)
        expect(popover).to_be_hidden()
        tokens.nth(i).hover()
        expect(popover).to_be_visible()
        pct = percentages(chat)
        assert len(pct) == 8, f"expected 8 alternatives, got {pct}"
        assert all(0.0 <= v <= 100.0 for v in pct), pct
        assert pct == sorted(pct, reverse=True), f"alternatives not sorted by probability: {pct}"
        p = float(tokens.nth(i).get_attribute("data-p") or "nan")
        expect(popover.get_by_test_id("popover-p")).to_have_text(f"{100 * p:.1f}%" if p >= 0.001 else "<0.1%")
    chat.page.mouse.move(5, 790)
    expect(popover).to_be_hidden()
    # a tap (click) opens it too
    tokens.nth(2).click()
    expect(popover).to_be_visible()


def test_a_tap_opens_the_popover_on_a_touch_screen(tiny_server: Server, new_page: Callable[..., ChatPage]) -> None:
    chat = new_page(tiny_server, viewport={"width": 400, "height": 760}, has_touch=True, is_mobile=True)
    chat.page.get_by_test_id("heatmap-toggle").check()
    chat.set_settings(max_new_tokens="40")
    chat.send("Tap a token.")
    chat.wait_done()
    chat.last_reply().get_by_test_id("token").nth(1).tap()
    popover = chat.page.get_by_test_id("popover")
    expect(popover).to_be_visible()
    chat.page.wait_for_timeout(300)
    expect(popover).to_be_visible()  # still open after the tap's trailing events
    chat.page.get_by_test_id("user-message").tap()
    expect(popover).to_be_hidden()
