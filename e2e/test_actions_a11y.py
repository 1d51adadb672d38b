"""Every protocol setting and presets; a heatmap to act on (next low-confidence token, mean log-probability and
perplexity, the probability after sampling); accessibility: a polite live region, the popover describing the focused
token, and axe-core finding no serious violations (tiny model)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from playwright.sync_api import Page, expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = pytest.mark.e2e

AXE = Path(__file__).resolve().parent / "vendor" / "axe.min.js"
FOCUSED_P = "() => Number(document.activeElement?.dataset?.p ?? NaN)"
FOCUSED_INDEX = "() => [...document.querySelectorAll('[data-testid=token]')].indexOf(document.activeElement)"


def test_every_setting_reaches_the_server(chat: ChatPage) -> None:
    chat.set_settings(temperature="0.9", top_k="12", top_p="0.9", min_p="0.01", typical_p="0.8",
                      repetition_penalty="1.1", repetition_range="64", frequency_penalty="0.5",
                      presence_penalty="-0.25", token_bias="7: -100\n12: 2.5", stop="###\\nEND", seed="5",
                      max_new_tokens="9", alternatives="3")
    chat.send("Settings check")
    chat.wait_done()
    req = [f for f in chat.sent if f.get("type") == "generate"][-1]
    assert req["settings"] == {"temperature": 0.9, "top_k": 12, "top_p": 0.9, "min_p": 0.01, "typical_p": 0.8,
                               "repetition_penalty": 1.1, "repetition_range": 64, "frequency_penalty": 0.5,
                               "presence_penalty": -0.25, "token_bias": {"7": -100, "12": 2.5}, "seed": 5}
    assert req["stop"] == ["###\nEND"] and req["max_new_tokens"] == 9 and req["alternatives"] == 3
    assert chat.request_frames("done")[-1]["reason"] in ("max_new_tokens", "stop_token", "stop_string")


def test_presets_built_in_and_saved(chat: ChatPage) -> None:
    page = chat.page
    page.get_by_test_id("settings-open").click()
    page.get_by_test_id("preset").select_option(label="Precise")
    expect(page.get_by_test_id("setting-temperature")).to_have_value("0")
    page.get_by_test_id("setting-temperature").fill("1.3")
    page.get_by_test_id("setting-top_k").fill("7")
    page.get_by_test_id("preset-name").fill("mine")
    page.get_by_test_id("preset-save").click()
    page.get_by_test_id("preset").select_option(label="Balanced")
    expect(page.get_by_test_id("setting-temperature")).to_have_value("0.7")
    chat.reload()
    chat.wait_connected()
    page.get_by_test_id("settings-open").click()
    page.get_by_test_id("preset").select_option(label="mine (yours)")
    expect(page.get_by_test_id("setting-temperature")).to_have_value("1.3")
    expect(page.get_by_test_id("setting-top_k")).to_have_value("7")
    page.get_by_test_id("preset-delete").click()
    expect(page.get_by_test_id("preset").locator("option", has_text="mine")).to_have_count(0)


def test_next_low_confidence_stats_and_post_sampling(chat: ChatPage) -> None:
    page = chat.page
    page.get_by_test_id("heatmap-toggle").check()
    chat.set_settings(max_new_tokens="60", alternatives="5", temperature="1", top_k="2", top_p="1", min_p="0")
    chat.send("Be unsure.")
    chat.wait_done()
    spans = chat.last_reply().get_by_test_id("token")
    ps = [float(p) for p in spans.evaluate_all("ss => ss.map(s => s.dataset.p)")]
    low = [i for i, p in enumerate(ps) if p < 0.3]
    assert len(low) >= 2, f"the tiny model should give some low-confidence tokens, got {ps}"
    page.get_by_test_id("next-low").click()
    assert page.evaluate(FOCUSED_INDEX) == low[0]
    page.keyboard.press("n")
    assert page.evaluate(FOCUSED_INDEX) == low[1]
    # mean log-probability and perplexity of the reply's tokens in its stats line
    mean = sum(math.log(p) for p in ps) / len(ps)
    expect(chat.last_reply().get_by_test_id("reply-status")).to_contain_text(
        f"mean logprob {mean:.2f} · perplexity {math.exp(-mean):.2f}")
    # top-k 2 at temperature 1: q = p / (p1 + p2) over the two most likely, exact from the listed alternatives
    checked = 0
    for i in range(8):
        tok = [t for t in chat.received_tokens() if t["text"] != ""][i]
        if tok["text"] != spans.nth(i).text_content() or spans.nth(i).get_attribute("data-parts"):
            continue  # a character merged from byte tokens: p and sampled_p are products over its parts
        spans.nth(i).focus()
        checked += 1
        top2 = sorted(tok["top"], key=lambda a: -a["p"])[:2]
        q = tok["p"] / sum(a["p"] for a in top2) if tok["rank"] <= 2 else 0.0
        expect(page.get_by_test_id("popover-meta")).to_contain_text(f"after sampling {100 * q:.1f}%")
        expect(spans.nth(i)).to_have_attribute("aria-describedby", "popover")
    assert checked > 0, "no single-token span among the first 8 to check"


def test_live_region_announces_sentences_not_tokens(chat: ChatPage) -> None:
    chat.set_settings(max_new_tokens="300", temperature="1")
    chat.send("Talk.")
    chat.wait_done()
    region = chat.page.get_by_test_id("announcer")
    expect(region).to_have_attribute("aria-live", "polite")
    count = int(region.get_attribute("data-count") or "0")
    tokens = len(chat.received_tokens())
    assert 1 <= count <= max(2, tokens // 10), f"{count} announcements for {tokens} tokens"
    expect(region).to_contain_text("(reply finished)")


def run_axe(page: Page) -> list[dict[str, Any]]:
    if not AXE.exists():
        pytest.fail(f"{AXE} is missing: scripts/setup.sh --test fetches axe-core from the npm registry")
    if page.evaluate("typeof window.axe") == "undefined":
        page.add_script_tag(path=str(AXE))
    result: dict[str, Any] = page.evaluate("axe.run(document, {runOnly: ['wcag2a', 'wcag2aa', 'best-practice']})")
    return [{"id": v["id"], "impact": v["impact"], "nodes": [n["target"] for n in v["nodes"]][:3]}
            for v in result["violations"] if v["impact"] in ("serious", "critical")]


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_axe_finds_no_serious_violations(tiny_server: Server, new_page: Callable[..., ChatPage], artifacts: Path,
                                         scheme: str) -> None:
    chat = new_page(tiny_server, color_scheme=scheme, bypass_csp=True)  # bypass_csp: only to inject axe.min.js
    assert run_axe(chat.page) == [], "empty page"
    chat.page.get_by_test_id("heatmap-toggle").check()
    chat.set_settings(max_new_tokens="40", alternatives="5")
    chat.send("Check me for accessibility. **Bold** and a list:\n- one\n- two")
    chat.wait_done()
    chat.last_reply().get_by_test_id("regenerate").click()
    chat.wait_done()
    chat.last_reply().get_by_test_id("token").nth(2).focus()
    expect(chat.page.get_by_test_id("popover")).to_be_visible()
    assert run_axe(chat.page) == [], "a reply with the heatmap and the popover open"
    chat.page.screenshot(path=str(artifacts / f"a11y-heatmap-{scheme}-desktop.png"))
    chat.page.get_by_test_id("settings-open").click()
    assert run_axe(chat.page) == [], "the settings panel open"
    chat.page.screenshot(path=str(artifacts / f"a11y-settings-{scheme}-desktop.png"))
    chat.page.get_by_test_id("settings-close").click()
    chat.page.set_viewport_size({"width": 390, "height": 844})
    chat.page.locator("#sidebar-toggle").click()
    assert run_axe(chat.page) == [], "phone width, sidebar open"
    chat.page.screenshot(path=str(artifacts / f"a11y-sidebar-{scheme}-phone.png"))
    chat.page.locator("#sidebar-toggle").click(force=True)
    chat.page.screenshot(path=str(artifacts / f"a11y-chat-{scheme}-phone.png"))
