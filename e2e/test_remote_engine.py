"""The page on a remote engine: `webchat serve --engine-url` pointing at another webchat (tiny model). The header
names the upstream and what its heatmap can show; tokens come coloured with their alternatives; a branch from an
alternative continues upstream with the chosen prefix, sent as its token ids."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import httpx
import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = pytest.mark.e2e

SPANS_JS = """() => [...document.querySelectorAll('[data-testid=assistant-message]:last-of-type .tok:not(.tok-cont)')]
  .map(s => ({p: s.dataset.p, rank: s.dataset.rank, bg: getComputedStyle(s).backgroundColor}))"""


@pytest.fixture(scope="module")
def servers(launch_tiny: Callable[..., Server]) -> Iterator[tuple[Server, Server]]:
    """(a tiny-model webchat, a `webchat serve --engine-url` in front of it): this module's own pair, so it runs
    once whichever engine the page suite's `tiny_server` is."""
    upstream = launch_tiny()
    front = launch_tiny("--engine-url", upstream.url.rstrip("/"))
    yield front, upstream
    front.stop()
    upstream.stop()


def test_the_heatmap_and_a_branch_on_a_remote_engine(servers: tuple[Server, Server],
                                                      new_page: Callable[..., ChatPage]) -> None:  # fmt: skip
    remote_server, tiny_server = servers
    engine = httpx.get(f"{remote_server.url}api/info").json()["engine"]
    assert engine["state"] == "ready" and engine["kind"] == "webchat"
    chat = new_page(remote_server)
    expect(chat.page.locator("#model-info")).to_contain_text(f"webchat at {tiny_server.url.rstrip('/')}")
    info = chat.page.get_by_test_id("engine-info")
    expect(info).to_be_visible()
    expect(info).to_contain_text("probabilities raw")
    expect(info).to_contain_text("top 20 alternatives")
    expect(info).to_contain_text("token ids per_entry")
    expect(info).to_contain_text("branches as token ids (tokenize)")
    chat.page.get_by_test_id("heatmap-toggle").check()
    chat.set_settings(max_new_tokens="24", alternatives="5", temperature="0")
    chat.send("Colour me from afar.")
    chat.wait_done()
    got = chat.page.evaluate(SPANS_JS)
    tokens = [t for t in chat.received_tokens() if t["text"] != ""]
    assert len(got) == len(tokens) > 0
    assert all(0.0 < float(s["p"]) <= 1.0 for s in got), got  # real probabilities, not "null" or zeros
    assert all(s["bg"] not in ("", "rgba(0, 0, 0, 0)", "transparent", "rgb(204, 204, 204)") for s in got), got
    assert chat.reply_text() == chat.received_text()
    old_text = chat.reply_text()
    chat.last_reply().get_by_test_id("token").first.click()
    popover = chat.page.get_by_test_id("popover")
    expect(popover).to_be_visible()
    expect(popover.get_by_test_id("popover-meta")).to_contain_text("rank 1")
    assert popover.locator("li.chosen").count() == 1
    picks = popover.get_by_test_id("alt-pick")
    assert picks.count() > 0, "expected alternatives to branch with"
    alt_text = picks.first.text_content()
    alt_p = float(picks.first.locator("xpath=..").get_attribute("data-p") or "nan")
    picks.first.click()
    chat.wait_done()
    req = [f for f in chat.sent if f.get("type") == "generate"][-1]
    assert req.get("continue") is True
    first = chat.received_tokens(chat.request_frames("done")[-2]["id"])[0]
    alt = next(a for a in first["top"] if abs(a["p"] - alt_p) < 1e-12)
    assert req.get("prefix_ids") == [alt["id"]], "the branch goes upstream as the chosen token's id"
    new_id = chat.request_frames("done")[-1]["id"]
    assert chat.received_text(new_id), "the upstream continued nothing"
    assert chat.reply_text() == req["messages"][-1]["content"] + chat.received_text(new_id)
    assert chat.reply_text() != old_text and alt_text
