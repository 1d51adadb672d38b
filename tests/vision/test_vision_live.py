"""A vision model served for real (uvicorn on a free port, the SmolVLM-shaped mini fixture with --mmproj): images on
the websocket's `generate` and in the API's `image_url` parts, the hello and model list saying it reads images, image
tokens counted in usage; hostile images answered on both wires with a 4xx (or `bad_image`) naming the problem and the
part, while another client's stream goes on."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_server import Live, serve  # tests/ is on sys.path under pytest
from websockets.sync.client import connect

from bench import vision_fidelity as vf
from tests.vision.pictures import picture, png_declaring
from webchat.serve.config import ServerConfig
from webchat.serve.images import IMAGE_MESSAGE_BYTES

pytestmark = pytest.mark.timeout(300)
TEXT = "What is in this picture?"


@pytest.fixture(scope="module")
def live(smolvlm: Any) -> Iterator[Live]:
    from webchat.files.gguf_cache import model_folder

    config = ServerConfig(model_dir=model_folder(smolvlm.text_gguf), mmproj=smolvlm.mmproj_f16, speculative="none",
                          max_message_bytes=IMAGE_MESSAGE_BYTES, max_queue=8)
    with serve(config, vf.runtime(smolvlm, "exact")) as running:
        yield running


def ws_parts(url: str) -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}]


def generate(ws: Any, rid: str, content: Any, **extra: Any) -> list[dict[str, Any]]:
    """A generate's replies up to its done or error."""
    ws.send(json.dumps({"type": "generate", "id": rid, "messages": [{"role": "user", "content": content}],
                        "settings": {"temperature": 0.0}, "max_new_tokens": 4, **extra}))
    out = []
    while True:
        msg = json.loads(ws.recv(timeout=120))
        if msg.get("id") != rid:
            continue
        out.append(msg)
        if msg["type"] in ("done", "error"):
            return out


def completion(live: Live, content: Any, **extra: Any) -> httpx.Response:
    model = httpx.get(f"{live.url}/v1/models").json()["data"][0]["id"]
    return httpx.post(f"{live.url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0,
        **extra})


def test_an_image_on_the_websocket_and_the_api(live: Live) -> None:
    url = vf.data_url(picture(2048, 512, 1))
    with connect(live.ws_url, max_size=None) as ws:
        hello = json.loads(ws.recv(timeout=30))
        assert hello["vision"]["projector"] == "idefics3" and hello["vision"]["max_tiles"] == 4
        assert [m["vision"] for m in hello["models"]] == [True]
        replies = generate(ws, "r1", ws_parts(url))
    start, done = replies[0], replies[-1]
    assert start["type"] == "start" and start["prompt_tokens"] == 346
    assert done["type"] == "done" and done["stats"]["image_tokens"] == 320
    resp = completion(live, ws_parts(url))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["prompt_tokens"] == 346 and body["stats"]["image_tokens"] == 320
    models = httpx.get(f"{live.url}/v1/models").json()["data"]
    assert [m["vision"] for m in models] == [True]


def b64(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


HOSTILE = {  # name: (content parts, what the answer says)
    "not an image": ([{"type": "image_url", "image_url": {"url": b64(b"hello, world")}}], "not an image"),
    "truncated": ([{"type": "image_url", "image_url": {"url": b64(base64.b64decode(
        vf.data_url(picture(300, 200, 5)).split(",")[1])[:900])}}], "truncated"),
    "bomb": ([{"type": "image_url", "image_url": {"url": b64(png_declaring(50_000, 50_000))}}], "more pixels than"),
    "http": ([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}], "the server fetches nothing"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_image_is_refused_by_name_on_both_wires(live: Live, name: str) -> None:
    parts, says = HOSTILE[name]
    with connect(live.ws_url, max_size=None) as ws:
        (error,) = generate(ws, "h", [{"type": "text", "text": "look"}, *parts])
    assert error["code"] == "bad_image" and says in error["message"] and "messages.0.content.1" in error["message"]
    resp = completion(live, [{"type": "text", "text": "look"}, *parts])
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "invalid_image" and err["param"] == "messages.0.content.1" and says in err["message"]


def test_a_hundred_images_in_a_message_and_a_body_past_the_limit_are_refused(live: Live) -> None:
    one = {"type": "image_url", "image_url": {"url": vf.data_url(picture(8, 8, 1))}}
    resp = completion(live, [one] * 100)
    assert resp.status_code == 400 and "64" in resp.text  # at most 64 parts a message
    with connect(live.ws_url, max_size=None) as ws:
        (error,) = generate(ws, "many", [one] * 100)
        assert error["code"] == "bad_message" and "64" in error["message"]
    near = "data:image/png;base64," + "A" * (IMAGE_MESSAGE_BYTES - 4096)  # parses, then is no image
    resp = completion(live, [{"type": "image_url", "image_url": {"url": near}}])
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_image"
    past = "data:image/png;base64," + "A" * IMAGE_MESSAGE_BYTES
    resp = completion(live, [{"type": "image_url", "image_url": {"url": past}}])
    assert resp.status_code == 413 and str(IMAGE_MESSAGE_BYTES) in resp.text
    with connect(live.ws_url, max_size=None) as ws:
        ws.recv(timeout=30)
        ws.send(json.dumps({"type": "generate", "id": "big", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": past}}]}]}))
        error = json.loads(ws.recv(timeout=60))
        assert error["code"] == "too_large" and str(IMAGE_MESSAGE_BYTES) in error["message"]


def test_another_clients_stream_goes_on_while_hostile_images_come(live: Live) -> None:
    """Client B streams a long reply (each step slowed) while client A sends every hostile image in turn: A gets its
    refusals, and B's tokens keep coming after A's last one, to B's own end."""
    live.probe.delay = 0.03
    got: list[tuple[str, float]] = []
    order = threading.Lock()
    stamp = iter(range(10**6))

    def b() -> None:
        with connect(live.ws_url, max_size=None) as ws:
            ws.send(json.dumps({"type": "generate", "id": "b", "messages": [{"role": "user", "content": "Count on."}],
                                "settings": {"temperature": 0.0}, "max_new_tokens": 80}))
            while True:
                msg = json.loads(ws.recv(timeout=120))
                with order:
                    got.append((f"b:{msg['type']}", next(stamp)))
                if msg["type"] in ("done", "error"):
                    return

    thread = threading.Thread(target=b)
    try:
        thread.start()
        while not any(kind == "b:chunk" for kind, _ in got):
            thread.join(0.05)
        with connect(live.ws_url, max_size=None) as ws:
            for i, (parts, _) in enumerate(HOSTILE.values()):
                (error,) = generate(ws, f"a{i}", parts)
                with order:
                    got.append((f"a:{error['code']}", next(stamp)))
        thread.join(120)
    finally:
        live.probe.delay = 0.0
    a_last = max(n for kind, n in got if kind.startswith("a:"))
    assert [kind for kind, _ in got if kind.startswith("a:")] == ["a:bad_image"] * len(HOSTILE)
    assert any(kind == "b:chunk" and n > a_last for kind, n in got)  # B's stream went on after A's last refusal
    assert got[-1][0] == "b:done"


def front(upstream: str) -> Any:
    """A webchat generating on `upstream` (--engine-url); its lifespan probes whether the upstream takes images."""
    from pathlib import Path

    from live_server import free_port, uvicorn_thread

    from webchat.serve.app import create_app

    port = free_port()
    return uvicorn_thread(create_app(ServerConfig(model_dir=Path("."), port=port, engine_url=upstream,
                                                  max_message_bytes=IMAGE_MESSAGE_BYTES)), port)


def test_an_upstream_that_reads_images_gets_them_one_that_does_not_refuses_by_name(live: Live,
                                                                                 tiny_model_dir: Any) -> None:
    from webchat.serve.runtime import load_runtime

    url = vf.data_url(picture(640, 480, 2))
    with front(live.url) as base, connect(base.replace("http", "ws") + "/ws", max_size=None) as ws:
        hello = json.loads(ws.recv(timeout=30))
        assert hello["vision"] == {"projector": "upstream"} and hello["engine"]["images"] == "accepted"
        replies = generate(ws, "up", ws_parts(url))
        assert replies[-1]["type"] == "done" and replies[-1]["stats"]["prompt_tokens"] > 320  # the usage upstream
    text = ServerConfig(model_dir=tiny_model_dir, device="cpu", max_seq_len=256)
    with serve(text, load_runtime(text)) as text_live, front(text_live.url) as base:
        with connect(base.replace("http", "ws") + "/ws", max_size=None) as ws:
            assert json.loads(ws.recv(timeout=30))["vision"] is None
            (error,) = generate(ws, "no", ws_parts(url))
        assert "messages.0.content.0 is an image" in error["message"] and "does not take images" in error["message"]
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        resp = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": ws_parts(url)}], "max_tokens": 2})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages.0.content.0"


def test_logprobs_a_format_and_stop_work_on_a_reply_about_an_image(live: Live) -> None:
    url = vf.data_url(picture(640, 480, 3))
    resp = completion(live, ws_parts(url), logprobs=True, top_logprobs=3, response_format={"type": "json_object"})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["message"]["content"].startswith("{")  # the grammar held from the first token
    assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 3
    live.probe.delay = 0.05
    try:
        with connect(live.ws_url, max_size=None) as ws:
            ws.send(json.dumps({"type": "generate", "id": "s", "alternatives": 2, "max_new_tokens": 200,
                                "messages": [{"role": "user", "content": ws_parts(url)}]}))
            while (msg := json.loads(ws.recv(timeout=120)))["type"] != "chunk":
                pass
            assert len(msg["tokens"][0]["top"]) == 2  # the heatmap's alternatives
            ws.send(json.dumps({"type": "stop", "id": "s"}))
            while (msg := json.loads(ws.recv(timeout=120)))["type"] != "done":
                pass
    finally:
        live.probe.delay = 0.0
    assert msg["reason"] == "cancelled" and msg["stats"]["new_tokens"] < 200
