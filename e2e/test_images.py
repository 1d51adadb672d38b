"""Images in the page (issue 61): pasted, dropped or picked into the composer of a vision model (the SmolVLM-shaped
mini fixture served with --mmproj, random weights), sent as `image_url` parts, shown as a thumbnail that enlarges, a
reply that streams with its heatmap and stops, its footer's image tokens; kept on reload, through edit and regenerate,
through export and import (a crafted image refused by name); a file that is not an image, an image the server
refuses, and a model that reads text only, each leaving what the user typed in the composer."""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from page_driver import LONG_REPLY, start_server
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PASTE_JS = """([b64, name, type]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], name, {type}));
  document.getElementById('input').dispatchEvent(new ClipboardEvent('paste', {clipboardData: data, bubbles: true,
                                                                              cancelable: true}));
}"""
DROP_JS = """([b64, name, type]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], name, {type}));
  const composer = document.getElementById('composer');
  composer.dispatchEvent(new DragEvent('dragover', {dataTransfer: data, bubbles: true, cancelable: true}));
  composer.dispatchEvent(new DragEvent('drop', {dataTransfer: data, bubbles: true, cancelable: true}));
}"""
TEXT_MODEL = "tiny-text"


def png(width: int, height: int, seed: int) -> bytes:
    """A gradient with a seeded tint: each seed a different picture (the server caches an image by its pixels)."""
    from PIL import Image

    img = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    tint = Image.new("RGB", (width, height), ((seed * 70) % 256, (seed * 130) % 256, 90))
    out = io.BytesIO()
    Image.blend(img, tint, 0.4).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vision_server(e2e_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The SmolVLM-shaped mini fixture with its projector, and beside it in --models-dir a tiny model that reads text
    only (the picker offers both)."""
    from bench import vision_fixtures

    fixture = vision_fixtures.build("smolvlm-mini")
    shelf = tmp_path_factory.mktemp("shelf")
    (shelf / TEXT_MODEL).symlink_to(e2e_tiny_model_dir)
    server = start_server(fixture.text_gguf, tmp_path_factory.mktemp("logs") / "vision.log", "--mmproj",
                          str(fixture.mmproj_f16), "--models-dir", str(shelf), "--speculative", "none")
    yield server
    server.stop()


@pytest.fixture
def vchat(vision_server: Server, new_page: Callable[..., ChatPage]) -> ChatPage:
    chat: ChatPage = new_page(vision_server, accept_downloads=True)
    chat.set_settings(image_max_tiles="1")  # one tile (64 tokens): the fixture reads it in a fraction of a second
    return chat


def paste(chat: ChatPage, data: bytes, name: str, mime: str = "image/png") -> None:
    chat.page.evaluate(PASTE_JS, [base64.b64encode(data).decode(), name, mime])


def drop(chat: ChatPage, data: bytes, name: str, mime: str) -> None:
    chat.page.evaluate(DROP_JS, [base64.b64encode(data).decode(), name, mime])


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def generates(chat: ChatPage) -> list[dict[str, Any]]:
    return [f for f in chat.sent if f.get("type") == "generate"]


def image_urls(message: dict[str, Any]) -> list[str]:
    content = message["content"]
    return [] if isinstance(content, str) else [p["image_url"]["url"] for p in content if p["type"] == "image_url"]


def shown_images(chat: ChatPage) -> list[str]:
    return [str(img.get_attribute("src")) for img in chat.page.get_by_test_id("message-image").locator("img").all()]


def test_paste_send_stream_enlarge_stop_and_reload(vchat: ChatPage, artifacts: Path) -> None:
    page = vchat.page
    vchat.set_settings(max_new_tokens=LONG_REPLY, temperature="1")
    page.get_by_test_id("heatmap-toggle").check()
    picture = png(512, 384, 1)
    expect(page.get_by_test_id("attach")).to_be_enabled()
    paste(vchat, picture, "gradient.png")
    paste(vchat, png(300, 300, 2), "second.png")
    expect(page.get_by_test_id("pending-image")).to_have_count(2)
    page.get_by_test_id("pending-image").nth(1).get_by_test_id("remove-image").click()  # the x takes one back
    expect(page.get_by_test_id("pending-image")).to_have_count(1)
    paste(vchat, png(300, 300, 3), "third.png")
    page.get_by_test_id("input").fill("What is in these pictures?")
    page.screenshot(path=str(artifacts / "images-composer-desktop.png"))
    page.get_by_test_id("input").press("Enter")

    sent = generates(vchat)[-1]
    assert sent["image_max_tiles"] == 1
    user = sent["messages"][-1]
    assert user["content"][0] == {"type": "text", "text": "What is in these pictures?"}
    assert image_urls(user) == [data_url(picture), data_url(png(300, 300, 3))], "the images, in the order pasted"
    expect(page.get_by_test_id("pending-image")).to_have_count(0)
    assert shown_images(vchat) == image_urls(user)
    first = page.get_by_test_id("message-image").first
    expect(first).to_have_attribute("aria-label", "Enlarge gradient.png (512 × 384)")

    vchat.wait_until("the reply streams tokens", lambda: vchat.last_reply().get_by_test_id("token").count() > 8, 120)
    assert vchat.reply_state() == "streaming"
    page.get_by_test_id("message-image").first.click()  # the viewer, while the reply streams
    viewer = page.get_by_test_id("image-view")
    expect(viewer).to_be_visible()
    expect(viewer.get_by_test_id("image-view-img")).to_have_attribute("src", data_url(picture))
    expect(viewer.get_by_test_id("image-view-caption")).to_have_text("gradient.png (512 × 384)")
    page.screenshot(path=str(artifacts / "images-viewer-desktop.png"))
    page.keyboard.press("Escape")
    expect(viewer).to_be_hidden()
    assert vchat.reply_state() == "streaming", "Escape closed the viewer; it must not stop the reply"
    assert not [f for f in vchat.sent if f.get("type") == "stop"]
    spans = vchat.last_reply().get_by_test_id("token")
    assert spans.first.get_attribute("data-p") is not None, "the reply's tokens carry their probabilities"
    vchat.stop_and_wait()
    stats = vchat.request_frames("done")[-1]["stats"]
    assert vchat.reply_text() == vchat.received_text()
    tile = vchat.request_frames("hello")[-1]["vision"]["tokens_per_tile"]
    tokens = stats["image_tokens"]
    assert tokens == 2 * tile, f"two images of one tile each ({tile} tokens), got {stats}"
    footer = vchat.last_reply().get_by_test_id("reply-status").text_content() or ""
    seconds = re.search(rf"{tokens} image tokens, encoded in (\d+\.\d) s", footer)
    assert seconds and abs(float(seconds[1]) - stats["encode_ms"] / 1000) <= 0.051, footer
    page.screenshot(path=str(artifacts / "images-sent-desktop.png"))

    vchat.reload()
    vchat.wait_connected()
    assert shown_images(vchat) == image_urls(user), "IndexedDB keeps the images"
    expect(vchat.last_reply().get_by_test_id("reply-status")).to_contain_text(f"{tokens} image tokens")


def test_edit_regenerate_export_and_import_keep_the_images(vchat: ChatPage, vision_server: Server,
                                                           new_page: Callable[..., ChatPage], tmp_path: Path,
                                                           artifacts: Path) -> None:  # fmt: skip
    page = vchat.page
    vchat.set_settings(max_new_tokens="3")
    picture = png(256, 256, 4)
    page.get_by_test_id("attach-file").set_input_files(files=[{"name": "picked.png", "mimeType": "image/png",
                                                              "buffer": picture}])
    expect(page.get_by_test_id("pending-image")).to_have_count(1)
    vchat.send("Describe it.")
    vchat.wait_done(120_000)
    vchat.last_reply().get_by_test_id("regenerate").click()
    vchat.wait_done()
    assert image_urls(generates(vchat)[-1]["messages"][-1]) == [data_url(picture)], "regenerate resends the image"
    assert "from the cache" in (vchat.last_reply().get_by_test_id("reply-status").text_content() or "")
    page.get_by_test_id("user-message").get_by_test_id("edit").click()
    page.get_by_test_id("edit-input").fill("Describe it again.")
    page.get_by_test_id("edit-save").click()
    vchat.wait_done()
    edited = generates(vchat)[-1]["messages"][-1]
    assert edited["content"][0]["text"] == "Describe it again." and image_urls(edited) == [data_url(picture)]
    expect(page.get_by_test_id("user-message").get_by_test_id("version")).to_have_text("2/2")
    assert shown_images(vchat) == [data_url(picture)]

    with page.expect_download() as info:
        page.get_by_test_id("export-all").click()
    path = tmp_path / "export.json"
    info.value.save_as(path)
    doc = json.loads(path.read_text())
    assert doc["version"] == 4
    versions = doc["conversations"][0]["root"]["versions"]
    assert [v["msg"]["images"][0]["data"] for v in versions] == [base64.b64encode(picture).decode()] * 2

    other = new_page(vision_server, viewport={"width": 390, "height": 844})
    other.page.get_by_test_id("import-file").set_input_files(str(path))
    expect(other.page.get_by_test_id("import-status")).to_have_text("Imported 1 conversation")
    other.page.get_by_role("button", name="Show conversations").click()  # a phone's sidebar slides in
    other.page.get_by_test_id("conversation-list").get_by_text("Describe it again.").click()
    assert shown_images(other) == [data_url(picture)]
    other.page.get_by_test_id("user-message").get_by_test_id("version-prev").click()
    assert shown_images(other) == [data_url(picture)], "the first version's image came too"
    paste(other, png(640, 480, 5), "narrow.png")
    other.page.get_by_test_id("input").fill("A question typed on a phone")
    expect(other.page.get_by_test_id("pending-image")).to_have_count(1)
    other.page.screenshot(path=str(artifacts / "images-mobile.png"))


@pytest.mark.parametrize(("image", "field"), [
    ({"mime": "text/html", "data": "PGI+"}, "images[0].mime"),
    ({"mime": "image/png", "data": "not base64!"}, "images[0].data"),
    ({"mime": "image/png", "data": "A" * (16 << 20) + "AAAA"}, "images[0].data"),
])
def test_a_crafted_image_is_refused_by_name(vision_server: Server, new_page: Callable[..., ChatPage],
                                            tmp_path: Path, image: dict[str, Any], field: str) -> None:  # fmt: skip
    msg = {"role": "user", "content": "look", "images": [image]}
    conv = {"id": "x", "title": "crafted", "created": 1, "updated": 2,
            "root": {"versions": [{"msg": msg, "next": None}], "current": 0}}
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps({"format": "webchat-conversations", "version": 4, "conversations": [conv]}))
    chat = new_page(vision_server)
    chat.page.get_by_test_id("import-file").set_input_files(str(path))
    status = chat.page.get_by_test_id("import-status")
    expect(status).to_contain_text(field)
    expect(status).to_contain_text("nothing was imported")


def test_what_is_refused_leaves_the_composer_as_typed(vchat: ChatPage) -> None:
    page = vchat.page
    page.get_by_test_id("input").fill("my typed words")
    drop(vchat, b"just some notes\n", "notes.txt", "text/plain")
    expect(page.get_by_test_id("error")).to_contain_text("notes.txt is not an image")
    expect(page.get_by_test_id("input")).to_have_value("my typed words")
    expect(page.get_by_test_id("pending-image")).to_have_count(0)
    drop(vchat, png(64, 64, 6), "dropped.png", "image/png")
    expect(page.get_by_test_id("pending-image")).to_have_count(1)
    # the browser shows a 33000 x 1 strip; the server refuses it from its header (32768 a side): bad_image
    paste(vchat, png(33000, 1, 7), "strip.png")
    expect(page.get_by_test_id("pending-image")).to_have_count(2)
    page.get_by_test_id("input").press("Enter")
    error = page.get_by_test_id("error")
    expect(error).to_have_attribute("data-code", "bad_image", timeout=60_000)
    expect(error).to_contain_text("messages.0.content.2")
    expect(page.get_by_test_id("input")).to_have_value("my typed words")
    assert [i.get_attribute("alt") for i in page.get_by_test_id("pending-image").locator("img").all()] == [
        "dropped.png", "strip.png"], "both images are back in the composer"
    expect(page.get_by_test_id("user-message")).to_have_count(0)


def test_the_picker_marks_the_models_that_see(vchat: ChatPage) -> None:
    page = vchat.page
    picker = page.get_by_test_id("model-picker")
    options = {o.get_attribute("value"): o.text_content() or "" for o in picker.locator("option").all()}
    assert "reads images" not in options[TEXT_MODEL]
    assert [name for name, text in options.items() if "reads images" in text] == ["smolvlm-mini"]
    attach = page.get_by_test_id("attach")
    expect(attach).to_be_enabled()
    paste(vchat, png(64, 64, 8), "kept.png")
    page.get_by_test_id("input").fill("keep me")
    picker.select_option(TEXT_MODEL)
    expect(attach).to_be_disabled()
    expect(attach).to_have_attribute("title", f"{TEXT_MODEL} reads text only; pick a model that reads images "
                                              "(marked in the model list)")
    paste(vchat, png(64, 64, 9), "refused.png")
    expect(page.get_by_test_id("error")).to_contain_text("refused.png")
    page.get_by_test_id("send").click()  # the pending image cannot go to this model: nothing is sent, nothing lost
    expect(page.get_by_test_id("error")).to_have_attribute("data-code", "no_vision")
    assert generates(vchat) == []
    expect(page.get_by_test_id("input")).to_have_value("keep me")
    expect(page.get_by_test_id("pending-image")).to_have_count(1)
    picker.select_option("smolvlm-mini")
    expect(attach).to_be_enabled()


def test_the_tiles_setting(vchat: ChatPage) -> None:
    page = vchat.page
    tiles = vchat.request_frames("hello")[-1]["vision"]["max_tiles"]
    page.get_by_test_id("settings-open").click()
    field = page.get_by_test_id("setting-image_max_tiles")
    expect(field).to_have_value("1")
    expect(page.locator("#set-image_max_tiles ~ .hint")).to_contain_text(f"Empty = the server's {tiles}.")
    field.fill("37")
    expect(page.get_by_test_id("setting-error-image_max_tiles")).to_have_text('expected a value in [1, 36], got 37')
    field.fill("2")
    vchat.reload()
    vchat.wait_connected()
    expect(page.get_by_test_id("setting-image_max_tiles")).to_have_value("2")  # kept with the other settings


def test_a_server_that_reads_no_images_shows_no_attach_button(launch_tiny: Callable[..., Server],
                                                                new_page: Callable[..., ChatPage]) -> None:
    server = launch_tiny()
    try:
        chat = new_page(server)
        expect(chat.page.get_by_test_id("attach")).to_be_hidden()
        paste(chat, png(64, 64, 10), "nope.png")
        expect(chat.page.get_by_test_id("error")).to_contain_text("nope.png")
        expect(chat.page.get_by_test_id("pending-image")).to_have_count(0)
    finally:
        server.stop()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_axe_finds_no_serious_violations_with_images(vision_server: Server, new_page: Callable[..., ChatPage],
                                                     artifacts: Path, scheme: str) -> None:  # fmt: skip
    from test_actions_a11y import run_axe

    chat = new_page(vision_server, color_scheme=scheme, bypass_csp=True)  # bypass_csp: only to inject axe.min.js
    chat.set_settings(image_max_tiles="1", max_new_tokens="2")
    paste(chat, png(128, 96, 11), "axe.png")
    expect(chat.page.get_by_test_id("pending-image")).to_have_count(1)
    assert run_axe(chat.page) == [], "an image waiting in the composer"
    chat.send("Read this.")
    chat.wait_done(120_000)
    chat.page.get_by_test_id("message-image").click()
    expect(chat.page.get_by_test_id("image-view")).to_be_visible()
    assert run_axe(chat.page) == [], "the viewer open"
    chat.page.screenshot(path=str(artifacts / f"images-viewer-{scheme}-desktop.png"))
    chat.page.get_by_test_id("image-view-close").click()
    expect(chat.page.get_by_test_id("image-view")).to_be_hidden()
