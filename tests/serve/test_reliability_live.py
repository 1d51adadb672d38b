"""Issue 42 against a real `webchat serve` child, its RSS watched throughout (tests/live_child.py): header bombs and a
symbolic link loop in the models folder (rows 1-3), runaway chat templates (rows 5-7), and the API's errors in its
JSON shape (row 13)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from gguf_bombs import array_bomb, many_strings  # tests/ is on sys.path under pytest
from live_child import health_latencies, run_watched, serve
from websockets.sync.client import connect

from bench.tiny import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def shelf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shelf")
    make_tiny_model(root / "tiny-a", seed=0, max_seq_len=256)
    make_tiny_model(root / "tiny-b", seed=1, max_seq_len=256)
    return root


def ask_ws(url: str, model: str | None = None, timeout: float = 60) -> list[dict[str, Any]]:
    with connect(url.replace("http://", "ws://") + "/ws", open_timeout=10) as ws:
        assert json.loads(ws.recv(10))["type"] == "hello"
        ws.send(json.dumps({"type": "generate", "id": "r", "messages": HI, "max_new_tokens": 4,
                            "settings": {"temperature": 0.0}, **({"model": model} if model else {})}))
        msgs = []
        while True:
            msgs.append(json.loads(ws.recv(timeout)))
            if msgs[-1]["type"] in ("done", "error"):
                return msgs


# ---------------------------------------------------------------- rows 1-3: the models folder
@pytest.fixture(scope="module")
def usual_start(shelf: Path, tmp_path_factory: pytest.TempPathFactory) -> float:
    """Seconds a server with tiny-a and a models folder holding tiny-b takes to be healthy."""
    tmp = tmp_path_factory.mktemp("clean")
    (tmp / "models").mkdir()
    os.symlink(shelf / "tiny-b", tmp / "models" / "tiny-b")
    with serve(tmp, "--model", str(shelf / "tiny-a"), "--models-dir", str(tmp / "models")) as child:
        return child.started_s


BAD_ENTRIES = {  # name -> (how it is made, what its one log line says)
    "bomb.gguf": (lambda p: array_bomb(p), "declares an array of 1152921504606846976 uint8 items"),  # row 1
    "strings.gguf": (lambda p: many_strings(p), "holds more than 1048576 strings"),  # row 2
    "loop.gguf": (lambda p: os.symlink(p.name, p), "a symbolic link loop"),  # row 3
}


@pytest.mark.parametrize("name", list(BAD_ENTRIES))
def test_a_bad_entry_leaves_the_server_healthy_small_and_serving(shelf: Path, tmp_path: Path, usual_start: float,
                                                                name: str) -> None:
    models = tmp_path / "models"
    models.mkdir()
    os.symlink(shelf / "tiny-b", models / "tiny-b")
    make, words = BAD_ENTRIES[name]
    make(models / name)
    with serve(tmp_path, "--model", str(shelf / "tiny-a"), "--models-dir", str(models), kill_mb=1500) as child:
        print(f"{name}: healthy after {child.started_s:.1f} s (usual {usual_start:.1f} s), peak RSS "
              f"{child.peak_mb:.0f} MB")
        assert child.started_s < usual_start + 10
        listed = [m["id"] for m in httpx.get(f"{child.url}/v1/models").json()["data"]]
        assert listed == ["tiny-a", "tiny-b"]
        assert ask_ws(child.url, "tiny-b")[-1]["type"] == "done"  # the other model is served
        assert child.peak_mb < 1000, child.peak_mb
        log = child.text()
    lines = [line for line in log.splitlines() if f"/{name} left out: " in line]
    assert len(lines) == 1 and words in lines[0], log[-3000:]
    assert "Traceback" not in log


def test_a_header_bomb_as_model_is_one_line_at_once(tmp_path: Path) -> None:
    bomb = array_bomb(tmp_path / "bomb.gguf")
    proc = run_watched([sys.executable, "-m", "webchat.cli", "serve", "--model", str(bomb), "--port", "9"],
                       timeout=60, kill_mb=1500)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "bomb.gguf: key 'general.architecture' declares an array of" in lines[0], proc.stderr


# ---------------------------------------------------------------- rows 5-7: runaway chat templates
NINE_LOOPS = "".join(f"{{% for a{i} in xs %}}" for i in range(9)) + "{% endfor %}" * 9
TEMPLATES = {
    "loops": "{% set xs = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] %}" + NINE_LOOPS,  # row 5: no call at all
    "padding": "{{ ''|center(1500000000) }}",  # row 6
    "nested-range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # row 7
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                "{{ ns.s }}",  # row 7
}


def with_template(src: Path, dest: Path, template: str) -> Path:
    shutil.copytree(src, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return dest


@pytest.mark.parametrize("kind", list(TEMPLATES))
def test_a_runaway_template_is_its_requests_named_error_and_nobody_elses(shelf: Path, tmp_path: Path,
                                                                         kind: str) -> None:
    """Each request ends with its named error within the template's budget, /healthz answers within 1 s all the
    while, the memory comes back, and SIGTERM stops the server."""
    model = with_template(shelf / "tiny-a", tmp_path / kind, TEMPLATES[kind])
    with serve(tmp_path, "--model", str(model), "--models-dir", str(tmp_path / "none"), kill_mb=2500) as child:
        before = child.rss_mb()
        stop, latencies = threading.Event(), []
        poller = threading.Thread(target=health_latencies, args=(child.url, stop, latencies), daemon=True)
        poller.start()
        try:
            for _ in range(2):  # the second time the template is known to need more than the event loop's budget
                t0 = time.monotonic()
                end = ask_ws(child.url)[-1]
                took = time.monotonic() - t0
                assert end["type"] == "error" and end["code"] == "bad_message", end
                assert "the chat template" in end["message"] and ("budget" in end["message"]
                                                                  or "at most" in end["message"]), end
                assert took < 6, took
                body = {"model": kind, "messages": HI, "max_tokens": 2}
                api = httpx.post(f"{child.url}/v1/chat/completions", json=body, timeout=30)
                assert api.status_code == 400, api.text
                error = api.json()["error"]
                assert error["code"] == "invalid_messages" and "the chat template" in error["message"], error
        finally:
            stop.set()
            poller.join(10)
        print(f"{kind}: /healthz slowest {max(latencies):.3f} s of {len(latencies)}, peak RSS {child.peak_mb:.0f} "
              f"MB, RSS {before:.0f} -> {child.rss_mb():.0f} MB")
        assert latencies and max(latencies) < 1.0, max(latencies)
        assert child.rss_mb() - before < 100
        assert child.peak_mb - before < 600
        assert child.stop() < 10


# ---------------------------------------------------------------- row 13: the API's errors in its JSON shape
def assert_api_error(resp: httpx.Response, status: int, code: str, *words: str) -> dict[str, Any]:
    assert resp.status_code == status and resp.headers["content-type"].startswith("application/json"), resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert error["code"] == code and all(w in error["message"] for w in words), error
    return error


def test_every_api_error_is_in_the_apis_json_shape(shelf: Path, tmp_path: Path) -> None:
    with serve(tmp_path, "--model", str(shelf / "tiny-a"), "--models-dir", str(shelf)) as child:
        url = child.url
        assert_api_error(httpx.get(f"{url}/v1/models/nope"), 404, "model_not_found", "'nope'", "tiny-a", "tiny-b")
        assert_api_error(httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": HI}), 404,
                         "model_not_found", "tiny-a", "tiny-b")
        assert_api_error(httpx.get(f"{url}/tokenize"), 405, "method_not_allowed", "/tokenize takes POST, got GET")
        assert_api_error(httpx.delete(f"{url}/v1/models"), 405, "method_not_allowed")
        assert_api_error(httpx.get(f"{url}/v1/nothing"), 404, "unknown_url")
        assert_api_error(httpx.get(f"{url}/v1/models", headers={"host": "evil.example"}), 403, "host_not_allowed")
    with serve(tmp_path, "--model", str(shelf / "tiny-a"), "--access-token", "s3cret", token="s3cret") as child:
        assert_api_error(httpx.get(f"{child.url}/v1/models"), 401, "invalid_access_token", "access token")
        assert_api_error(httpx.get(f"{child.url}/tokenize"), 401, "invalid_access_token")
        page = httpx.get(f"{child.url}/")
        assert page.status_code == 401 and page.headers["content-type"].startswith("text/plain")
