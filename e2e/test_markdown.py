"""Markdown replies: lists, a table and a code block render while they stream and after a reload, and every token is
still one coloured span that opens its popover (a scripted socket sends a known reply; the page is the real one)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from playwright.sync_api import expect
from scripted import ScriptedSocket, wire_tokens

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = pytest.mark.e2e

# token pieces that cut across the markup on purpose: "**bold" and "**" on their own, a newline with the next marker
PIECES = [
    "## Plan", "\n", "Here", " is", " **", "bold", "**", " and", " `x", "`", ".\n\n",
    "- one", "\n-", " two", "\n  - nested", "\n", "1.", " first", "\n\n",
    "| a", " | b |", "\n|", "---|---|\n", "| 1", " | 2 |", "\n\n",
    "```python", "\n", "print", "(1)", "\n```", "\n",
    "See", " [docs](https://example.org/x)", " or [bad](javascript:alert(1)).",
]
SOURCE = "".join(PIECES)
SPLIT = PIECES.index("```python")  # stream up to the code block, look, then the rest

STRUCTURE_JS = """(el) => ({
  h: [...el.querySelectorAll('h4')].map(e => e.innerText),
  strong: [...el.querySelectorAll('strong')].map(e => e.innerText),
  code: [...el.querySelectorAll(':not(pre) > code')].map(e => e.innerText),
  items: [...el.querySelectorAll(':scope > ul > li')].length,
  nested: [...el.querySelectorAll('li > ul > li')].map(e => e.innerText),
  ol: [...el.querySelectorAll(':scope > ol > li')].map(e => e.innerText),
  th: [...el.querySelectorAll('th')].map(e => e.innerText.trim()),
  td: [...el.querySelectorAll('tbody tr:not(.md-sep) td')].map(e => e.innerText.trim()),
  pre: [...el.querySelectorAll('pre code')].map(e => e.textContent),
  lang: [...el.querySelectorAll('.code-lang')].map(e => e.innerText),
  links: [...el.querySelectorAll('a')].map(e => [e.innerText, e.getAttribute('href'), e.rel]),
  text: el.textContent,
  visible: el.innerText,
})"""
SPANS_JS = """(el) => [...el.querySelectorAll('[data-testid=token]')].map(s => ({
  p: Number(s.dataset.p), bg: getComputedStyle(s).backgroundColor, shown: s.innerText.length > 0,
  mark: s.querySelector('.md-mark') !== null}))"""


@pytest.fixture
def scripted(tiny_server: Server, new_page: Callable[..., ChatPage]) -> tuple[ChatPage, ScriptedSocket]:
    holder: list[ScriptedSocket] = []
    chat = new_page(tiny_server, before_open=lambda page: holder.append(ScriptedSocket(page).install()),
                    viewport={"width": 1280, "height": 900})
    return chat, holder[0]


def structure(chat: ChatPage) -> dict[str, Any]:
    result: dict[str, Any] = chat.last_reply().get_by_test_id("message-body").evaluate(STRUCTURE_JS)
    return result


def check_spans(chat: ChatPage, n: int) -> None:
    spans: list[dict[str, Any]] = chat.last_reply().get_by_test_id("message-body").evaluate(SPANS_JS)
    assert len(spans) == n, f"expected one span per token ({n}), got {len(spans)}"
    want = [t["p"] for t in wire_tokens(PIECES)[:n]]
    assert [s["p"] for s in spans] == want
    shown = [s for s in spans if s["shown"]]
    assert all(s["bg"] not in ("", "rgba(0, 0, 0, 0)") for s in shown), "a visible token without its colour"
    assert any(s["mark"] and s["shown"] for s in spans), "expected tokens that hold markup and text alike"


def check_full(chat: ChatPage) -> None:
    got = structure(chat)
    assert got["text"] == SOURCE, "the reply's textContent is not the source it was rendered from"
    assert got["h"] == ["Plan"] and got["strong"] == ["bold"] and got["code"] == ["x"]
    assert got["items"] == 2 and got["nested"] == ["nested"] and got["ol"] == ["first"]
    assert got["th"] == ["a", "b"] and got["td"] == ["1", "2"]
    assert got["pre"] == ["print(1)\n"] and got["lang"] == ["python"]
    assert got["links"] == [["docs", "https://example.org/x", "noopener noreferrer"]], "only http(s) links are links"
    for raw in ("**", "```", "|---", "## "):
        assert raw not in got["visible"], f"markup {raw!r} shows as text: {got['visible']!r}"
    assert "[bad](javascript:alert(1))" in got["visible"]


def hover_all(chat: ChatPage) -> list[str]:
    """Hovers every visible token span (with the heatmap on, markup-only ones show as a small coloured mark); the
    popover must show that token's probability."""
    popover = chat.page.get_by_test_id("popover")
    tokens = chat.last_reply().get_by_test_id("token")
    unseen = []
    for i in range(tokens.count()):
        span = tokens.nth(i)
        if not span.is_visible():
            unseen.append(span.evaluate("s => s.outerHTML"))
            continue
        chat.page.keyboard.press("Escape")  # the open popover may cover the next token
        span.hover()
        expect(popover).to_be_visible()
        p = float(span.get_attribute("data-p") or "nan")
        expect(popover.get_by_test_id("popover-p")).to_have_text(f"{100 * p:.1f}%")
    return unseen


def test_markdown_streams_renders_and_survives_reload(scripted: tuple[ChatPage, ScriptedSocket],
                                                      artifacts: Path) -> None:
    chat, sock = scripted
    chat.page.get_by_test_id("heatmap-toggle").check()
    chat.send("Show me Markdown.")
    chat.wait_until("the page sent its generate", lambda: len(sock.requests) == 1)
    sock.start()
    tokens = wire_tokens(PIECES)
    for t in tokens[:SPLIT]:
        sock.chunk([t])
    # every token of the first part (the table's cells come a token before its last "\n\n")
    chat.wait_until("the first part is on screen", lambda: len(structure(chat)["td"]) == 2
                    and chat.last_reply().get_by_test_id("token").count() == SPLIT)
    assert chat.reply_state() == "streaming"
    mid = structure(chat)
    assert mid["text"] == "".join(PIECES[:SPLIT])
    assert mid["strong"] == ["bold"] and mid["nested"] == ["nested"] and mid["th"] == ["a", "b"], mid
    check_spans(chat, SPLIT)
    chat.page.screenshot(path=str(artifacts / "markdown-streaming-desktop.png"))
    sock.chunk(tokens[SPLIT:])
    sock.done(len(tokens))
    chat.wait_done()
    check_full(chat)
    check_spans(chat, len(tokens))
    assert hover_all(chat) == []
    chat.page.screenshot(path=str(artifacts / "markdown-done-desktop.png"))
    chat.page.set_viewport_size({"width": 390, "height": 844})
    chat.last_reply().scroll_into_view_if_needed()
    chat.page.wait_for_timeout(400)  # the sidebar slides out of a narrow viewport (a 0.15 s transition)
    chat.page.screenshot(path=str(artifacts / "markdown-done-phone.png"))
    chat.page.set_viewport_size({"width": 1280, "height": 900})
    chat.reload()
    chat.wait_connected()
    chat.page.get_by_test_id("heatmap-toggle").wait_for()
    expect(chat.last_reply()).to_have_attribute("data-state", "done")
    check_full(chat)
    check_spans(chat, len(tokens))
    assert hover_all(chat) == []


def test_code_block_copy_button(scripted: tuple[ChatPage, ScriptedSocket]) -> None:
    chat, sock = scripted
    chat.page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    chat.send("Code please.")
    chat.wait_until("the page sent its generate", lambda: len(sock.requests) == 1)
    sock.start()
    pieces = ["```js", "\n", "let x", " = 1;", "\n```"]
    sock.chunk(wire_tokens(pieces))
    sock.done(len(pieces))
    chat.wait_done()
    copy = chat.last_reply().get_by_test_id("code-copy")
    expect(copy).to_have_accessible_name("Copy code")
    copy.click()
    assert chat.page.evaluate("navigator.clipboard.readText()") == "let x = 1;\n"
    expect(copy).to_have_attribute("data-label", "Copied")


# every flush of a streaming reply made to cost 8 ms of the main thread (a long paragraph on a busy machine), and the
# time of each one kept
SLOW_FLUSH_JS = """async () => {
  const { MarkdownWriter } = await import('/static/blocks.js');
  const flush = MarkdownWriter.prototype.flush;
  window.__flushes = [];
  MarkdownWriter.prototype.flush = function () {
    const t = performance.now();
    while (performance.now() - t < 8) { /* the cost */ }
    flush.call(this);
    window.__flushes.push(performance.now());
  };
}"""


def test_a_costly_flush_spaces_the_next_ones(scripted: tuple[ChatPage, ScriptedSocket]) -> None:
    """Where writing the reply into the page costs the main thread more, the page writes it less often (reply.js,
    FLUSH_BUDGET): on a small machine the browser's redraws come out of the model's cores. Nothing is dropped."""
    chat, sock = scripted
    chat.page.evaluate(SLOW_FLUSH_JS)
    chat.send("Tell me a long story.")
    chat.wait_until("the page sent its generate", lambda: len(sock.requests) == 1)
    sock.start()
    pieces = [f"word{i} " for i in range(240)]  # one paragraph
    for t in wire_tokens(pieces):
        sock.chunk([t])
        chat.page.wait_for_timeout(10)
    chat.page.wait_for_timeout(300)
    times: list[float] = chat.page.evaluate("window.__flushes")
    sock.done(len(pieces))
    chat.wait_done()
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    assert len(gaps) >= 4, times
    # FLUSH_MS (50 ms) apart while the average cost builds up; from then on 60 x 8 ms, capped at 200
    assert gaps[len(gaps) // 2] >= 150, gaps
    body = chat.last_reply().get_by_test_id("message-body")
    assert body.evaluate("e => e.textContent") == "".join(pieces)
