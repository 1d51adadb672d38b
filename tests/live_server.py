"""A real uvicorn on a free port in a thread, its engine wrapped so tests can slow its steps and see the steps after
a cancel: shared by the live websocket and OpenAI API tests (imported as a module: tests/ is on sys.path under
pytest)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import httpx
import uvicorn

from webchat.serve.app import create_app
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime


class Probe:
    """The served engine, seen by a test: each step sleeps `delay` first (so requests overlap), and the steps a
    cancelled sequence is still stepped in are counted (1: the step that ends it). Everything else is the engine's."""

    def __init__(self, engine: Any, delay: float = 0.0) -> None:
        self.engine, self.delay = engine, delay
        self.after_cancel: dict[Any, int] = {}  # sequence -> steps that began with its cancel already set
        self.started: list[tuple[int, list[int], Any]] = []  # (engine step, prompt ids, StartInfo) per admission

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add(self, owner: Any, request: Any) -> Any:
        seq, info = self.engine.add(owner, request)
        self.started.append((self.engine.steps, list(request.prompt_ids), info))
        return seq, info

    def step(self) -> None:
        time.sleep(self.delay)
        # a cancel set while a step runs is that step's to miss (it checked before); from the next step on, each
        # one the sequence is in counts: "stops within one step" is at most one such step
        stepped = [(seq, seq.cancel.is_set()) for seq in self.engine.running]
        self.engine.step()
        for seq, began_cancelled in stepped:
            if seq.cancel.is_set():
                self.after_cancel[seq] = self.after_cancel.get(seq, 0) + began_cancelled

    @property
    def steps_after_cancel(self) -> int:
        return max(self.after_cancel.values(), default=0)


@dataclass
class Live:
    url: str
    ws_url: str
    app: Any
    probe: Probe

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = httpx.get(f"{self.url}/healthz").json()
        return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def uvicorn_thread(app: Any, port: int | None = None) -> Iterator[str]:
    """Any ASGI app on uvicorn in a thread (on `port`, or a free one): the one place a test runs a server in
    process. Yields its base URL once it answers, stops it afterwards."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, ws="websockets-sansio",
                                           log_level="warning", ws_max_size=64 << 20))  # `serve`'s with images
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start on port {port}")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "uvicorn did not shut down"


@contextmanager
def serve(config: ServerConfig, runtime: Runtime, delay: float = 0.0, port: int | None = None) -> Iterator[Live]:
    """webchat's app on `runtime` (its engine wrapped in a Probe) in a thread; yields once it answers."""
    port = port or free_port()
    probe = Probe(runtime.engine, delay)
    rt = replace(runtime, engine=probe)
    app = create_app(replace(config, port=port), runtime=rt)
    with uvicorn_thread(app, port) as url:
        yield Live(url, url.replace("http://", "ws://") + "/ws", app, probe)
