"""What the e2e tests drive: a `webchat serve` child on a free port (Server, start_server) and the page in Chromium
(ChatPage); the fixtures that make them are e2e/conftest.py's."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from live_child import launch, wait_healthy  # tests/ is on sys.path under pytest
from playwright.sync_api import ConsoleMessage, Locator, Page, WebSocket, expect

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SERVER_START_S = 180.0
TINY_CONTEXT = 8192  # long enough that a reply can outlast any check made while it streams
LONG_REPLY = "6000"  # max_new_tokens for replies the tests stop: ~15 s of the tiny model, which runs ~400 tokens/s


# ---------------------------------------------------------------- the server
@dataclass
class Server:
    """A running `webchat serve` child process and where it listens."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    log: BinaryIO
    stopped: bool = False  # stopped on purpose: not a crash
    engine: str = "local"  # "remote": a `webchat serve --engine-url` in front of another webchat
    upstream: Server | None = None

    def stop(self) -> None:
        self.stopped = True
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if not self.stopped and self.proc.poll() is not None:
            pytest.fail(f"webchat serve exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")


def start_server(model_dir: Path, log_path: Path, *extra: str, port: int | None = None) -> Server:
    """`webchat serve --model DIR` on loopback (tests/live_child.py's launch), waited for until /healthz answers;
    the test fails with the log tail if it dies."""
    if "--models-dir" not in extra and "--engine-url" not in extra:  # the one model, not the user's shelf
        extra = (*extra, "--models-dir", str(log_path.parent / "no-models"))
    proc, port = launch(log_path, "--model", str(model_dir), "--host", "127.0.0.1", *extra, port=port)
    server = Server(proc=proc, url=f"http://127.0.0.1:{port}/", log_path=log_path, log=log_path.open("ab"))
    try:
        wait_healthy(server.url.rstrip("/"), proc, SERVER_START_S, server.log_tail)
    except AssertionError as exc:
        server.stop()
        pytest.fail(str(exc))
    return server


@dataclass
class ChatPage:
    """One tab on the chat page, with every websocket frame the server sent it and every page error."""

    page: Page
    server: Server
    frames: list[dict[str, Any]] = field(default_factory=list)
    sent: list[dict[str, Any]] = field(default_factory=list)  # what the page sent (generate, stop)
    errors: list[str] = field(default_factory=list)

    def open(self) -> ChatPage:
        self.page.on("websocket", self._watch)
        self.page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        self.page.on("console", self._console)
        self.page.goto(self.server.url)
        self.wait_connected()
        return self

    def _console(self, msg: ConsoleMessage) -> None:
        if msg.type == "error":
            self.errors.append(f"console.error: {msg.text}")

    def _watch(self, ws: WebSocket) -> None:
        def on_frame(payload: str | bytes) -> None:
            self.frames.append(json.loads(payload))

        ws.on("framereceived", on_frame)
        ws.on("framesent", lambda payload: self.sent.append(json.loads(payload)))

    def wait_connected(self) -> None:
        self.page.wait_for_selector("[data-testid=status][data-state=open]", timeout=15_000)

    def reload(self) -> None:
        """The page reloaded once its IndexedDB writes have committed (a reload aborts a write in flight: the page
        counts them in body[data-saving])."""
        self.page.wait_for_selector("body:not([data-saving]), body[data-saving='0']", state="attached", timeout=15_000)
        self.page.reload()

    def set_settings(self, **values: str) -> None:
        if self.page.get_by_test_id("settings-panel").is_hidden():
            self.page.get_by_test_id("settings-open").click()
        for key, value in values.items():
            self.page.get_by_test_id(f"setting-{key}").fill(value)
            error = self.page.get_by_test_id(f"setting-error-{key}").text_content()
            assert error == "", f"setting {key}={value!r} was refused by the page: {error}"
        self.page.get_by_test_id("settings-close").click()

    def send(self, text: str) -> None:
        self.page.get_by_test_id("input").fill(text)
        self.page.get_by_test_id("input").press("Enter")

    def last_reply(self) -> Locator:
        return self.page.get_by_test_id("assistant-message").last

    def reply_text(self) -> str:
        return str(self.last_reply().get_by_test_id("message-body").text_content() or "")

    def reply_state(self) -> str:
        return str(self.last_reply().get_attribute("data-state") or "")

    def wait_done(self, timeout_ms: int = 60_000) -> None:
        expect(self.last_reply()).to_have_attribute("data-state", "done", timeout=timeout_ms)

    def wait_until(self, what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Polls `check` (Python, so the page's CSP, which forbids eval, does not get in the way)."""
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
            self.page.wait_for_timeout(10)

    def request_frames(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.frames if f.get("type") == kind]

    def last_request_id(self) -> str:
        ids = [f["id"] for f in self.frames if f.get("type") in ("queued", "start", "chunk", "done", "error")]
        assert ids, "the server sent nothing about any request"
        return str(ids[-1])

    def received_text(self, request_id: str | None = None) -> str:
        """The reply as the server sent it: the request's chunk texts joined (default: the latest request)."""
        rid = request_id or self.last_request_id()
        return "".join(f["text"] for f in self.request_frames("chunk") if f["id"] == rid)

    def received_tokens(self, request_id: str | None = None) -> list[dict[str, Any]]:
        rid = request_id or self.last_request_id()
        return [t for f in self.request_frames("chunk") if f["id"] == rid for t in f.get("tokens") or []]

    def stop_and_wait(self) -> None:
        self.page.get_by_test_id("stop").click()
        self.wait_done(timeout_ms=5_000)
        assert self.request_frames("done")[-1]["reason"] == "cancelled"

    def observe_growth(self, min_observations: int = 3, timeout_s: float = 30.0) -> list[int]:
        """Reply lengths seen while it streams, each longer than the last; polls the DOM until the reply ends."""
        lengths: list[int] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.reply_state()
            n = len(self.reply_text())
            if state == "streaming" and n > 0 and (not lengths or n > lengths[-1]):
                lengths.append(n)
            if state == "done" or len(lengths) >= max(min_observations, 8):
                break
            self.page.wait_for_timeout(15)
        return lengths


