"""Scoring on the page (issue 41): Score on the user's own message shows its tokens coloured with a summary, the rank
bins recolour them, a pasted text is scored, and with two models "Score with…" shows both views side by side with
the difference colouring; scores are kept with the chat."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from playwright.sync_api import Locator, expect
from test_model_picker import two_models  # noqa: F401  (the fixture: a server with two tiny models)

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = pytest.mark.e2e

SPANS_JS = """(panel) => [...panel.querySelectorAll('[data-testid=score-col]')].map(col => ({
  model: col.dataset.model,
  summary: col.querySelector('[data-testid=score-summary]').textContent,
  tokens: [...col.querySelectorAll('[data-testid=score-token]')].map(s => ({
    text: s.textContent, p: s.dataset.p === 'null' ? null : Number(s.dataset.p),
    rank: s.dataset.rank === 'null' ? null : Number(s.dataset.rank),
    delta: s.dataset.delta === undefined || s.dataset.delta === 'null' ? null : Number(s.dataset.delta),
    bg: getComputedStyle(s).backgroundColor})),
}))"""
BIN_COLOURS_JS = """async (ts) => {
  const m = await import('/static/heatmap.js');
  return ts.map(t => m.probColor(t));
}"""
DIFF_COLOURS_JS = """async (ds) => {
  const m = await import('/static/scorecolor.js');
  return ds.map(d => m.diffColor(d).bg);
}"""
GREY = "rgb(204, 204, 204)"


def views(panel: Locator) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = panel.evaluate(SPANS_JS)
    return result


def user_message(chat: ChatPage) -> Locator:
    return chat.page.get_by_test_id("user-message").last


def score_message(chat: ChatPage, message: Locator) -> Locator:
    message.get_by_test_id("score").click()
    panel = message.get_by_test_id("score-panel")
    expect(panel).to_be_visible(timeout=30_000)
    return panel


def test_score_a_user_message_then_rank_bins(chat: ChatPage, artifacts: Path) -> None:
    chat.set_settings(max_new_tokens="8", temperature="0")
    text = "The quick brown fox jumps over the lazy dog."
    chat.send(text)
    chat.wait_done()
    panel = score_message(chat, user_message(chat))
    frame = [f for f in chat.sent if f.get("type") == "score"][-1]
    assert frame["messages"][-1] == {"role": "user", "content": text}
    scored = [f for f in chat.frames if f.get("type") == "scored"][-1]
    (view,) = views(panel)
    assert "".join(t["text"] for t in view["tokens"]) == text
    assert len(view["tokens"]) == len(scored["tokens"])
    assert all(t["p"] is not None for t in view["tokens"])  # in its chat, every token has context before it
    assert view["summary"].startswith(f"{len(view['tokens'])} tokens · mean logprob ")
    assert "perplexity" in view["summary"] and "top-10" in view["summary"]
    probs = chat.page.evaluate(BIN_COLOURS_JS, [t["p"] for t in view["tokens"]])
    assert [t["bg"] for t in view["tokens"]] == probs, "a token's colour is not probColor(p) in probability mode"
    chat.page.screenshot(path=str(artifacts / f"score-message-{chat.server.engine}.png"))

    panel.get_by_test_id("score-mode").select_option("rank")
    expect(panel).to_have_attribute("data-mode", "rank")
    panel = user_message(chat).get_by_test_id("score-panel")
    (view,) = views(panel)
    bins = [1, 10, 100, 1000]
    want_t = [[1, 0.75, 0.5, 0.25, 0][next((i for i, top in enumerate(bins) if t["rank"] <= top), 4)]
              for t in view["tokens"]]
    assert [t["bg"] for t in view["tokens"]] == chat.page.evaluate(BIN_COLOURS_JS, want_t)
    expect(panel.get_by_test_id("score-legend")).to_contain_text("top 1000")
    panel.locator("[data-testid=score-token]").nth(2).hover()
    expect(chat.page.get_by_test_id("popover")).to_be_visible()
    expect(chat.page.get_by_test_id("popover").get_by_test_id("alt").first).to_be_visible()
    assert chat.page.get_by_test_id("popover").get_by_test_id("alt-pick").count() == 0  # a score branches nothing
    chat.page.screenshot(path=str(artifacts / f"score-rank-bins-{chat.server.engine}.png"))

    chat.reload()  # kept with the chat
    chat.wait_connected()
    panel = user_message(chat).get_by_test_id("score-panel")
    expect(panel).to_be_visible()
    assert views(panel)[0]["tokens"] == view["tokens"]
    panel.get_by_test_id("score-hide").click()
    expect(user_message(chat).get_by_test_id("score-panel")).to_have_count(0)
    expect(user_message(chat).get_by_test_id("score")).to_have_text("Show score")


def test_score_a_pasted_text(chat: ChatPage, artifacts: Path) -> None:
    chat.page.get_by_test_id("score-text-open").click()
    text = "Paste any text here: the model reads it and colours every token."
    chat.page.get_by_test_id("score-input").fill(text)
    chat.page.get_by_test_id("score-run").click()
    panel = chat.page.get_by_test_id("score-result").get_by_test_id("score-panel")
    expect(panel).to_be_visible(timeout=30_000)
    assert [f for f in chat.sent if f.get("type") == "score"][-1]["text"] == text
    (view,) = views(panel)
    assert "".join(t["text"] for t in view["tokens"]) == text
    first, rest = view["tokens"][0], view["tokens"][1:]
    assert first["p"] is None and first["bg"] == GREY  # nothing precedes the first token: unknown, grey
    assert all(t["p"] is not None and t["bg"] != GREY for t in rest)
    assert view["summary"].startswith(f"{len(view['tokens'])} tokens · mean logprob ")
    panel.locator("[data-testid=score-token]").nth(3).hover()
    expect(chat.page.get_by_test_id("score-popover")).to_be_visible()
    chat.page.screenshot(path=str(artifacts / f"score-text-{chat.server.engine}.png"))
    chat.reload()
    chat.wait_connected()
    chat.page.get_by_test_id("score-text-open").click()
    expect(chat.page.get_by_test_id("score-input")).to_have_value(text)
    expect(chat.page.get_by_test_id("score-result").get_by_test_id("score-token")).to_have_count(len(view["tokens"]))


def test_score_with_another_model_side_by_side(two_models: Server,  # noqa: F811
                                               new_page: Callable[..., ChatPage], artifacts: Path) -> None:
    chat = new_page(two_models)
    chat.set_settings(max_new_tokens="8", temperature="0")
    text = "Which of the two models finds this sentence more natural?"
    chat.send(text)
    chat.wait_done()
    panel = score_message(chat, user_message(chat))
    default = views(panel)[0]["model"]
    panel.get_by_test_id("score-with").select_option("tiny-b")
    chat.wait_until("two views", lambda: len(views(user_message(chat).get_by_test_id("score-panel"))) == 2)
    panel = user_message(chat).get_by_test_id("score-panel")
    a, b = views(panel)
    assert (a["model"], b["model"]) == (default, "tiny-b")
    assert [t["text"] for t in a["tokens"]] == [t["text"] for t in b["tokens"]]  # one tokenizer: token by token
    assert [t["p"] for t in a["tokens"]] != [t["p"] for t in b["tokens"]], "two models gave the same probabilities"
    panel.get_by_test_id("score-mode").select_option("diff")
    panel = user_message(chat).get_by_test_id("score-panel")
    expect(panel).to_have_attribute("data-mode", "diff")
    a, b = views(panel)
    for x, y in zip(a["tokens"], b["tokens"], strict=True):
        assert x["delta"] is not None and y["delta"] is not None
        assert x["delta"] == pytest.approx(-y["delta"], abs=1e-9)
        assert x["delta"] == pytest.approx(math.log(x["p"]) - math.log(y["p"]), abs=1e-9)
    assert [t["bg"] for t in a["tokens"]] == chat.page.evaluate(DIFF_COLOURS_JS, [t["delta"] for t in a["tokens"]])
    assert len({t["bg"] for t in a["tokens"]}) > 3, "expected the differences to differ in colour"
    chat.page.screenshot(path=str(artifacts / "score-side-by-side.png"))


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_axe_finds_no_serious_violations_in_the_score_views(tiny_server: Server, new_page: Callable[..., ChatPage],
                                                            scheme: str) -> None:
    from test_actions_a11y import run_axe

    chat = new_page(tiny_server, color_scheme=scheme, bypass_csp=True)  # bypass_csp: only to inject axe.min.js
    chat.set_settings(max_new_tokens="6")
    chat.send("Score me, please.")
    chat.wait_done()
    panel = score_message(chat, user_message(chat))
    panel.locator("[data-testid=score-token]").nth(1).focus()
    expect(chat.page.get_by_test_id("popover")).to_be_visible()
    assert run_axe(chat.page) == [], "a scored message with the popover open"
    for mode in ("rank", "surprise"):
        user_message(chat).get_by_test_id("score-mode").select_option(mode)
        assert run_axe(chat.page) == [], f"the score panel by {mode}"
    chat.page.get_by_test_id("score-text-open").click()
    chat.page.get_by_test_id("score-input").fill("A pasted text to score.")
    chat.page.get_by_test_id("score-run").click()
    expect(chat.page.get_by_test_id("score-result").get_by_test_id("score-panel")).to_be_visible(timeout=30_000)
    assert run_axe(chat.page) == [], "the Score a text view with its result"
