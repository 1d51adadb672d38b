"""The reply format (Settings → "Reply format"): a chat with a JSON schema replies with valid JSON, shown highlighted
with every token still its own heatmap span; the popover marks the alternatives the grammar forbade; the format is
kept with the chat; a branch from an alternative keeps it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import jsonschema
import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "tags": {"type": "array", "items": {"enum": ["old", "big", "cold"]},
                                                    "minItems": 1, "maxItems": 2}},
          "required": ["city", "rank", "tags"], "additionalProperties": False}


def ask_with_schema(chat: ChatPage, schema: dict[str, object], question: str) -> str:
    """Heatmap on, the schema set in Settings, the question asked: the reply's text when it is done."""
    chat.page.get_by_test_id("heatmap-toggle").check()
    chat.set_settings(max_new_tokens="200", alternatives="8")
    set_schema(chat, schema)
    chat.send(question)
    chat.wait_done()
    text = chat.reply_text()
    jsonschema.validate(json.loads(text), schema)
    return text


def set_schema(chat: ChatPage, schema: dict[str, object]) -> None:
    page = chat.page
    page.get_by_test_id("settings-open").click()
    page.get_by_test_id("setting-reply_format").select_option("json_schema")
    page.get_by_test_id("setting-reply_schema").fill(json.dumps(schema))
    expect(page.get_by_test_id("setting-error-reply_format")).to_have_text("")
    page.get_by_test_id("settings-close").click()


def test_a_json_schema_in_settings_gives_valid_highlighted_json(chat: ChatPage, artifacts: Path) -> None:
    page = chat.page
    text = ask_with_schema(chat, SCHEMA, "Name a city, as JSON.")
    sent = [f for f in chat.sent if f.get("type") == "generate"][-1]
    assert sent["response_format"] == {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    reply = chat.last_reply()
    expect(reply.get_by_test_id("json-reply")).to_be_visible()
    tokens = reply.get_by_test_id("token")
    assert "".join(tokens.all_text_contents()) == text  # every token its own span, their text the reply
    assert tokens.count() == len([t for t in chat.received_tokens() if t["text"]])
    assert reply.locator(".j-key").count() >= 3 and reply.locator(".j-num").count() >= 1
    if chat.server.engine == "local":  # a remote engine's upstream does not say what its grammar forbade
        received = [t for t in chat.received_tokens() if t["text"]]
        k = next(i for i, t in enumerate(received) if t.get("forbidden"))
        tokens.nth(k).hover()
        popover = page.get_by_test_id("popover")
        expect(popover).to_be_visible()
        barred = popover.locator("[data-forbidden=true]")
        expect(barred.first).to_be_visible()
        assert barred.count() == len(received[k]["forbidden"])
        expect(barred.first.get_by_test_id("alt-forbidden")).to_have_text("forbidden")
        assert barred.first.get_by_test_id("alt-pick").count() == 0  # no branch from a forbidden token
        page.screenshot(path=str(artifacts / "reply-format.png"))
    chat.reload()
    chat.wait_connected()
    page.get_by_test_id("settings-open").click()
    expect(page.get_by_test_id("setting-reply_format")).to_have_value("json_schema")  # kept with the chat
    assert json.loads(page.get_by_test_id("setting-reply_schema").input_value()) == SCHEMA
    assert chat.errors == []


NOTE = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 8}}, "required": ["note"],
        "additionalProperties": False}  # inside its string most alternatives are allowed: one to branch on


def test_a_branch_from_an_alternative_keeps_the_format(chat: ChatPage) -> None:
    page = chat.page
    ask_with_schema(chat, NOTE, "A note, as JSON.")
    tokens = chat.last_reply().get_by_test_id("token")
    popover = page.get_by_test_id("popover")
    for k in range(tokens.count()):  # the first token with an allowed alternative to branch on
        if not (tokens.nth(k).text_content() or "").strip():
            continue  # whitespace (a newline) has no box to point at
        page.mouse.move(0, 0)  # the last token's popover away (it may cover this one)
        expect(popover).to_be_hidden()
        tokens.nth(k).hover()
        expect(popover).to_be_visible()
        if popover.get_by_test_id("alt-pick").count():
            break
    popover.get_by_test_id("alt-pick").first.click()
    chat.wait_done()
    sent = [f for f in chat.sent if f.get("type") == "generate"][-1]
    assert sent["continue"] is True and sent["response_format"]["json_schema"]["schema"] == NOTE
    jsonschema.validate(json.loads(chat.reply_text()), NOTE)
