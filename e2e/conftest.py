"""End-to-end fixtures: the real `webchat serve` on a free port, Debian's Chromium driven by Playwright, a chat page."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from page_driver import (  # e2e/ is on sys.path under pytest
    ARTIFACTS,
    CHROMIUM_ARGS,
    LONG_REPLY,
    TINY_CONTEXT,
    ChatPage,
    Server,
    start_server,
)
from playwright.sync_api import Browser, Page, sync_playwright


@pytest.fixture(scope="session")
def e2e_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.tiny import make_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    make_tiny_model(path, max_seq_len=TINY_CONTEXT)
    return path


ENGINES = [e for e in os.environ.get("WEBCHAT_E2E_ENGINES", "local,remote").split(",") if e]


@pytest.fixture(scope="session", params=ENGINES)
def tiny_server(request: pytest.FixtureRequest, e2e_tiny_model_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # fmt: skip
    """The tiny-model server, once as it is (`local`) and once behind a `webchat serve --engine-url` pointing at it
    (`remote`), so every page test also runs on a remote engine (docs/scale-out.md). WEBCHAT_E2E_ENGINES=local runs
    only the first (a quicker loop while working on the page)."""
    logs = tmp_path_factory.mktemp("logs")
    server = start_server(e2e_tiny_model_dir, logs / "tiny-server.log")
    if request.param == "local":
        yield server
        server.stop()
        return
    front = start_server(e2e_tiny_model_dir, logs / "remote-front.log", "--engine-url", server.url.rstrip("/"))
    front.engine, front.upstream = "remote", server
    yield front
    front.stop()
    server.stop()


@pytest.fixture(scope="session")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from webchat.files.pull import ensure_default_model

    server = start_server(ensure_default_model(), tmp_path_factory.mktemp("logs") / "real-server.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def launch_tiny(e2e_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Server]:
    """Start another tiny-model server with extra `serve` options (optionally on a given port); the caller stops it."""
    logs = tmp_path_factory.mktemp("more-logs")

    def launch(*extra: str, port: int | None = None) -> Server:
        return start_server(e2e_tiny_model_dir, logs / f"tiny-{time.monotonic_ns()}.log", *extra, port=port)

    return launch


# ---------------------------------------------------------------- the browser
@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.fail("the e2e tests need Debian's Chromium at /usr/bin/chromium: run scripts/setup.sh --test")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def new_page(browser: Browser) -> Iterator[Callable[..., ChatPage]]:
    """Factory: a fresh context (own localStorage) and page on a server; page errors fail the test."""
    pages: list[ChatPage] = []
    contexts = []

    def make(server: Server, color_scheme: str = "light", before_open: Callable[[Page], None] | None = None,
             **options: Any) -> ChatPage:
        options = {"viewport": {"width": 1280, "height": 800}, **options}
        ctx = browser.new_context(color_scheme=color_scheme, **options)  # type: ignore[arg-type]
        contexts.append(ctx)
        chat = ChatPage(page=ctx.new_page(), server=server)
        pages.append(chat)
        if before_open is not None:
            before_open(chat.page)  # e.g. a scripted websocket, installed before the page loads
        return chat.open()

    yield make
    errors = [e for chat in pages for e in chat.errors]
    for ctx in contexts:
        ctx.close()
    for chat in pages:
        chat.server.check_alive()  # a crash fails the test that caused it
    assert errors == [], f"the page reported errors: {errors}"


@pytest.fixture(scope="session")
def long_reply() -> str:
    """max_new_tokens for a tiny-model reply that streams until the test stops it."""
    return LONG_REPLY


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """artifacts/ at the repository root (gitignored): screenshots the tests save for people to look at."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def chat(tiny_server: Server, new_page: Callable[..., ChatPage]) -> ChatPage:
    return new_page(tiny_server)  # type: ignore[no-any-return]
