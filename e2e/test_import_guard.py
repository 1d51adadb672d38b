"""No imported file can break the page (issue 23): a crafted export is refused as a whole, naming its first bad field,
and nothing of it is kept; a bad conversation placed straight into IndexedDB is shown as far as it can be, marked,
and the page still loads everything else."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = pytest.mark.timeout(180)


def conversation(cid: str, reply: dict[str, Any], current: int = 0) -> dict[str, Any]:
    user = {"role": "user", "content": "hello"}
    return {"id": cid, "title": f"chat {cid}", "named": True, "created": 1, "updated": 2,
            "root": {"versions": [{"msg": user, "next": {"versions": [{"msg": reply, "next": None}],
                                                         "current": current}}], "current": 0}}


GOOD_REPLY = {"role": "assistant", "content": "Hi there", "reason": "stop_token",
              "stats": {"ttft_ms": 12.0, "decode_tps": 30.5, "new_tokens": 2},
              "tokens": [{"text": "Hi", "p": 0.5, "rank": 1, "top": [{"text": "Hi", "p": 0.5}]},
                         {"text": " there", "p": 0.25, "rank": 2, "top": [{"text": " you", "p": 0.5}]}]}


def export(tmp_path: Path, convs: list[dict[str, Any]], name: str) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"format": "webchat-conversations", "version": 2, "conversations": convs}))
    return path


@pytest.mark.parametrize(("bad", "field"), [
    (conversation("b", {**GOOD_REPLY, "stats": {"decode_tps": "x"}}), "stats.decode_tps"),
    (conversation("b", GOOD_REPLY, current=5), "current"),
    (conversation("b", {**GOOD_REPLY, "tokens": [{"text": "Hi", "p": 7, "rank": 1, "top": []}]}), "tokens[0].p"),
])
def test_a_crafted_file_is_refused_whole_and_the_page_stays_usable(tiny_server: Server,
                                                                   new_page: Callable[..., ChatPage], tmp_path: Path,
                                                                   bad: dict[str, Any], field: str) -> None:
    page = new_page(tiny_server)
    path = export(tmp_path, [conversation("a", GOOD_REPLY), bad], "crafted.json")
    page.page.get_by_test_id("import-file").set_input_files(str(path))
    status = page.page.get_by_test_id("import-status")
    expect(status).to_contain_text("conversation 2 of 2")
    expect(status).to_contain_text(field)
    expect(status).to_contain_text("nothing was imported")
    expect(page.page.get_by_test_id("conversation").filter(has_text="chat a")).to_have_count(0)  # not even the good one
    page.reload()
    page.wait_connected()
    expect(page.page.locator("body[data-ready=true]")).to_have_count(1)
    for cid in ("a", "b"):
        expect(page.page.get_by_test_id("conversation").filter(has_text=f"chat {cid}")).to_have_count(0)
    page.set_settings(max_new_tokens="4")
    page.send("still here?")  # the page works
    page.wait_done()


def test_a_bad_conversation_in_storage_is_marked_and_the_others_load(tiny_server: Server,
                                                                      new_page: Callable[..., ChatPage]) -> None:
    page = new_page(tiny_server)
    bad = conversation("bad", {**GOOD_REPLY, "stats": {"decode_tps": "x"}}, current=5)
    good = conversation("good", GOOD_REPLY)
    page.page.evaluate("""async (convs) => {
        const db = await new Promise((ok, fail) => {
            const req = indexedDB.open("webchat");
            req.onsuccess = () => ok(req.result);
            req.onerror = () => fail(req.error);
        });
        await new Promise((ok, fail) => {
            const tx = db.transaction("conversations", "readwrite");
            for (const c of convs) tx.objectStore("conversations").put(c);
            tx.oncomplete = ok;
            tx.onerror = () => fail(tx.error);
        });
        db.close();
    }""", [bad, good])
    page.reload()
    page.wait_connected()
    expect(page.page.locator("body[data-ready=true]")).to_have_count(1)
    items = page.page.get_by_test_id("conversation")
    expect(items.filter(has_text="chat good")).to_have_count(1)
    damaged = items.filter(has_text="chat bad")
    expect(damaged).to_have_count(1)
    expect(damaged).to_contain_text("⚠")
    damaged.get_by_role("button").first.click()  # opening it renders what is sound: the reply's text, no stats
    expect(page.page.get_by_test_id("assistant-message").first).to_contain_text("Hi there")
    items.filter(has_text="chat good").get_by_role("button").first.click()
    expect(page.page.get_by_test_id("assistant-message").first).to_contain_text("Hi there")
    # a new reply saves the repaired conversation; it checks out from then on, and its mark goes
    items.filter(has_text="chat bad").get_by_role("button").first.click()
    page.set_settings(max_new_tokens="4")
    page.send("and now?")
    page.wait_done()
    page.reload()
    page.wait_connected()
    expect(page.page.locator("body[data-ready=true]")).to_have_count(1)
    repaired = page.page.get_by_test_id("conversation").filter(has_text="chat bad")
    expect(repaired).to_have_count(1)
    expect(repaired).not_to_contain_text("⚠")
