"""A real uvicorn on a free port in a thread, every generator wrapped so tests can see steps after a cancel: shared by
the live websocket and OpenAI API tests (imported as a module: tests/ is on sys.path under pytest)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import uvicorn

from webchat.serve.app import create_app
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime
from webchat.serve.worker import StreamingGenerator


@dataclass
class Counted:
    """A generator wrapper that sleeps `delay` per step and counts the stream() calls made after cancel()."""

    gen: StreamingGenerator
    delay: float = 0.0
    cancelled: bool = False
    calls_after_cancel: int = 0

    def begin_stream(self, request: Any) -> Any:
        self.cancelled, self.calls_after_cancel = False, 0
        return self.gen.begin_stream(request)

    def stream(self) -> Any:
        if self.cancelled:
            self.calls_after_cancel += 1
        time.sleep(self.delay)
        return self.gen.stream()

    def cancel(self) -> None:
        self.cancelled = True
        self.gen.cancel()


@dataclass
class Live:
    url: str
    ws_url: str
    app: Any
    generators: list[Counted] = field(default_factory=list)

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = httpx.get(f"{self.url}/healthz").json()
        return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def serve(config: ServerConfig, runtime: Runtime, delay: float = 0.0, port: int | None = None) -> Iterator[Live]:
    """uvicorn in a thread (on `port`, or a free one); yields once it answers, stops it (and the worker) afterwards."""
    port = port or free_port()
    rt = replace(runtime)
    app = create_app(replace(config, port=port), runtime=rt)
    live = Live(f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/ws", app)
    base = runtime.new_generator

    def new_generator() -> StreamingGenerator:
        gen = Counted(base(), delay)
        live.generators.append(gen)
        return gen

    rt.new_generator = new_generator  # type: ignore[method-assign]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, ws="websockets-sansio",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start on port {port}")
        time.sleep(0.02)
    try:
        yield live
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "uvicorn did not shut down"
