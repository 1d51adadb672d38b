"""Thinking in the page (issue 40): the "Thinking" fold above the answer on a tiny random Qwen3 with Qwen3's real
template, forced to think by a logit bias on `<think>` (its head gives that token logit 0, so it never comes by
itself); the fold's heatmap and popover, a branch from a thinking token, the per-chat Think switch, Copy; an
imported reply with `<think>…</think>` in its text, folded without the tags; export and import keeping it all."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from page_driver import TINY_CONTEXT, start_server
from playwright.sync_api import expect

from bench.tiny import make_tiny_qwen3
from webchat.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from page_driver import ChatPage, Server
    from playwright.sync_api import Page, WebSocketRoute

pytestmark = pytest.mark.e2e

QWEN3 = (Path(__file__).parent.parent / "tests" / "fixtures" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
BUDGET = 24  # --reasoning-budget
# the fold's (open, state) each time the messages change, recorded in the page: a fast model's thinking may be over
# before a poll from here could see it
WATCH_FOLD_JS = """() => { window.foldSeen = [];
  new MutationObserver(() => { const f = [...document.querySelectorAll('[data-testid=thinking]')].pop();
    if (f) window.foldSeen.push(`${f.open}:${f.dataset.state}`); })
  .observe(document.getElementById('messages'), {subtree: true, childList: true, attributes: true,
                                                 characterData: true}); }"""
THOUGHT = re.compile(r"^Thought for \d+\.\d s · \d+ tokens?$")
TEXT_BEFORE_JS = """el => { const r = document.createRange();
  r.setStart(el.closest('[data-testid=thinking-body]'), 0); r.setEndBefore(el); return r.toString(); }"""


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), QWEN3, max_seq_len=TINY_CONTEXT)


@pytest.fixture(scope="session")
def qwen3_server(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(qwen3_dir, tmp_path_factory.mktemp("logs") / "qwen3-server.log",
                          "--reasoning-budget", str(BUDGET), "--stream-interval-ms", "0")  # a chunk a step
    yield server
    server.stop()


@pytest.fixture(scope="session")
def think_id(qwen3_dir: Path) -> int:
    return Tokenizer.from_dir(qwen3_dir).encode("<think>")[0]


def force_thinking(chat: ChatPage, think_id: int, max_new_tokens: int) -> None:
    chat.set_settings(temperature="0", token_bias=f"{think_id}: 20", repetition_penalty="10", presence_penalty="2",
                      frequency_penalty="2", max_new_tokens=str(max_new_tokens), alternatives="5")


def received(chat: ChatPage, key: str) -> str:
    rid = chat.last_request_id()
    return "".join(f.get(key, "") for f in chat.request_frames("chunk") if f["id"] == rid)


def paced_chunks(page: Page) -> None:
    """The server's chunks reach the page 50 ms apart, as a model the size people run streams: the tiny model's whole
    reply otherwise arrives within one paint, and the fold never shows the thinking while it streams."""

    def route(ws: WebSocketRoute) -> None:
        server = ws.connect_to_server()

        def forward(message: str | bytes) -> None:
            if isinstance(message, str) and '"type":"chunk"' in message.replace(" ", ""):
                time.sleep(0.05)
            ws.send(message)

        server.on_message(forward)

    page.route_web_socket(re.compile(r"/ws$"), route)


def test_a_reply_forced_to_think_streams_into_the_fold(qwen3_server: Server, new_page: Callable[..., ChatPage],
                                                       think_id: int, artifacts: Path) -> None:
    chat = new_page(qwen3_server, before_open=paced_chunks, permissions=["clipboard-read", "clipboard-write"])
    expect(chat.page.get_by_test_id("think-toggle")).to_be_checked()  # Qwen3's template takes enable_thinking
    force_thinking(chat, think_id, BUDGET + 16)
    chat.page.evaluate(WATCH_FOLD_JS)
    chat.send("What is two plus two?")
    fold = chat.last_reply().get_by_test_id("thinking")
    expect(fold).to_have_count(1, timeout=30_000)
    chat.page.screenshot(path=str(artifacts / "thinking-streaming.png"))
    chat.wait_done()
    seen = chat.page.evaluate("window.foldSeen")
    assert "true:streaming" in seen, f"the fold was never open while its thinking streamed: {seen}"
    assert seen[-1] == "false:done", f"the fold did not fold when the answer started: {seen}"
    assert not fold.evaluate("el => el.open")
    summary = fold.get_by_test_id("thinking-summary").text_content() or ""
    assert THOUGHT.match(summary), summary
    thinking, answer = received(chat, "thinking"), received(chat, "text")
    assert thinking.strip() and answer.strip()
    assert chat.reply_text() == answer and "<think>" not in chat.reply_text()
    assert fold.get_by_test_id("thinking-body").text_content() == thinking
    sent = [f for f in chat.sent if f.get("type") == "generate"][-1]
    assert sent["chat_template_kwargs"] == {"enable_thinking": True}
    chat.page.screenshot(path=str(artifacts / "thinking-folded.png"))
    # inside the fold: the same heatmap spans and popover as the answer
    chat.page.get_by_test_id("heatmap-toggle").check()
    fold.get_by_test_id("thinking-summary").click()
    spans = fold.get_by_test_id("token")
    assert spans.count() > 5
    spans.nth(2).click()
    expect(chat.page.get_by_test_id("popover")).to_be_visible()
    assert chat.page.get_by_test_id("alt").count() == 5
    chat.page.screenshot(path=str(artifacts / "thinking-heatmap.png"))
    chat.page.keyboard.press("Escape")
    chat.last_reply().get_by_test_id("copy").click()
    assert chat.page.evaluate("navigator.clipboard.readText()") == answer  # Copy copies the answer alone


def test_a_branch_from_a_thinking_token_goes_on_thinking(qwen3_server: Server, new_page: Callable[..., ChatPage],
                                                         think_id: int) -> None:
    chat = new_page(qwen3_server)
    force_thinking(chat, think_id, BUDGET + 8)
    chat.page.get_by_test_id("heatmap-toggle").check()
    chat.send("Branch inside the thinking.")
    chat.wait_done()
    fold = chat.last_reply().get_by_test_id("thinking")
    fold.get_by_test_id("thinking-summary").click()
    spans = fold.get_by_test_id("token")
    span = spans.nth(min(3, spans.count() - 1))
    kept = span.evaluate(TEXT_BEFORE_JS)
    span.click()
    pick = chat.page.get_by_test_id("alt-pick").first
    alt_text = (pick.text_content() or "").replace("␣", " ").replace("↵", "\n").replace("⇥", "\t")
    pick.click()
    chat.wait_done()
    req = [f for f in chat.sent if f.get("type") == "generate"][-1]
    assert req["continue"] is True and req["prefix_ids"][0] == think_id  # the model's own tokens, <think> first
    assert req["messages"][-1]["content"].startswith("<think>")
    expect(chat.last_reply().get_by_test_id("version")).to_have_text("2/2")
    new_fold = chat.last_reply().get_by_test_id("thinking-body")
    assert (new_fold.text_content() or "").startswith(kept + alt_text)
    assert received(chat, "thinking") != "", "the branch's continuation is thinking"


def test_the_think_switch_is_kept_per_chat_and_sent_as_enable_thinking(qwen3_server: Server,
                                                                      new_page: Callable[..., ChatPage]) -> None:
    chat = new_page(qwen3_server)
    chat.set_settings(max_new_tokens="4", temperature="0")
    toggle = chat.page.get_by_test_id("think-toggle")
    toggle.uncheck()
    chat.send("No thinking, please.")
    chat.wait_done()
    assert [f for f in chat.sent if f.get("type") == "generate"][-1]["chat_template_kwargs"] == \
        {"enable_thinking": False}
    assert chat.last_reply().get_by_test_id("thinking").count() == 0
    chat.page.get_by_test_id("new-chat").click()
    expect(toggle).to_be_checked()  # a new chat thinks
    chat.page.get_by_test_id("conversation").filter(has_text="No thinking").get_by_role("button").first.click()
    expect(toggle).not_to_be_checked()
    chat.reload()
    chat.wait_connected()
    expect(toggle).not_to_be_checked()


TOKENS = [("<think>", "", "thinking"), ("\n", "", "thinking"), ("Let", "Let", "thinking"), (" me", " me", "thinking"),
          (" add.", " add.", "thinking"), ("\n", "\n", "thinking"), ("</think>", "", "thinking"),
          ("\n\n", "", None), ("The", "The", None), (" answer is 42.", " answer is 42.", None)]


def imported_doc() -> dict[str, Any]:
    """An export whose reply holds its thinking in its text (an older page, another tool): tags and all."""
    tokens = [{"id": i, "text": raw, "p": 0.5 + i / 40, "rank": 1, "top": [{"id": i, "text": raw, "p": 0.5 + i / 40}]}
              for i, (raw, _, _) in enumerate(TOKENS)]
    content = "".join(raw for raw, _, _ in TOKENS)
    reply: dict[str, Any] = {"role": "assistant", "content": content, "tokens": tokens, "reason": "stop_token"}
    root = {"versions": [{"msg": {"role": "user", "content": "What is six times seven?"},
                          "next": {"versions": [{"msg": reply, "next": None}], "current": 0}}], "current": 0}
    return {"format": "webchat-conversations", "version": 2, "exported": "2026-01-01T00:00:00Z",
            "conversations": [{"id": "imported-1", "title": "Six times seven", "created": 1, "updated": 2,
                               "root": root}]}


def test_an_imported_reply_with_a_thinking_block_renders_folded_and_round_trips(
        qwen3_server: Server, new_page: Callable[..., ChatPage], tmp_path: Path, artifacts: Path) -> None:
    path = tmp_path / "thinking.json"
    path.write_text(json.dumps(imported_doc()))
    a = new_page(qwen3_server, accept_downloads=True)
    a.page.get_by_test_id("import-file").set_input_files(str(path))
    expect(a.page.get_by_test_id("import-status")).to_have_text("Imported 1 conversation")
    a.page.get_by_test_id("conversation").filter(has_text="Six times seven").get_by_role("button").first.click()
    reply = a.last_reply()
    fold = reply.get_by_test_id("thinking")
    expect(fold).to_have_count(1)
    assert not fold.evaluate("el => el.open")
    expect(fold.get_by_test_id("thinking-summary")).to_have_text("Thought · 4 tokens")
    assert a.reply_text() == "The answer is 42."
    assert "<think>" not in (reply.text_content() or "")
    fold.get_by_test_id("thinking-summary").click()
    assert fold.evaluate("el => el.open")
    expect(fold.get_by_test_id("thinking-body")).to_have_text("Let me add.")
    a.page.get_by_test_id("heatmap-toggle").check()
    inside = fold.get_by_test_id("token")
    assert [s.get_attribute("data-p") for s in inside.all()][:3] == [str(0.5 + i / 40) for i in (2, 3, 4)]
    a.page.screenshot(path=str(artifacts / "thinking-imported.png"))
    with a.page.expect_download() as info:
        a.page.get_by_test_id("export-all").click()
    exported = tmp_path / "export.json"
    info.value.save_as(exported)
    msg = json.loads(exported.read_text())["conversations"][0]["root"]["versions"][0]["next"]["versions"][0]["msg"]
    assert (msg["thinking"], msg["content"]) == ("Let me add.\n", "The answer is 42.")
    assert [(t["text"], t.get("part")) for t in msg["tokens"]] == [(text, part) for _, text, part in TOKENS]
    b = new_page(qwen3_server)
    b.page.get_by_test_id("import-file").set_input_files(str(exported))
    expect(b.page.get_by_test_id("import-status")).to_have_text("Imported 1 conversation")
    b.page.get_by_test_id("conversation").filter(has_text="Six times seven").get_by_role("button").first.click()
    b.page.get_by_test_id("heatmap-toggle").check()
    fold_b = b.last_reply().get_by_test_id("thinking")
    assert b.reply_text() == "The answer is 42."
    expect(fold_b.get_by_test_id("thinking-body")).to_have_text("Let me add.")
    assert fold_b.get_by_test_id("token").count() == inside.count()
