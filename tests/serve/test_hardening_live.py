"""Issue 12 against a real `webchat serve` child process: silent sockets under a low file limit, a client that floods
without reading (server RSS and its session), accept errors logged once per interval."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from live_child import Child  # tests/ is on sys.path under pytest
from live_child import serve as serve_child
from websockets.sync.client import connect as ws_connect

from webchat.serve.limits import AcceptErrorLog

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@contextmanager
def serve(model_dir: Path, tmp_path: Path, *extra: str, nofile: int | None = None) -> Iterator[Child]:
    with serve_child(tmp_path, "--model", str(model_dir), *extra, nofile=nofile, ready_s=120) as child:
        yield child


def hello_over_websocket(child: Child) -> dict[str, object]:
    with ws_connect(f"ws://127.0.0.1:{child.port}/ws", open_timeout=10) as ws:
        msg: dict[str, object] = json.loads(ws.recv(timeout=10))
        return msg


def test_400_silent_sockets_under_256_files_do_not_lock_out_a_new_client(tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    with serve(tiny_model_dir, tmp_path, "--max-seq-len", "512", "--handshake-timeout", "60", nofile=256) as child:
        socks = []
        for i in range(400):  # half say nothing, half stop in the middle of their headers
            s = socket.create_connection(("127.0.0.1", child.port), timeout=5)
            if i % 2:
                s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            socks.append(s)
        try:
            time.sleep(1.0)
            t0 = time.monotonic()
            r = httpx.get(f"{child.url}/healthz", timeout=10)
            assert r.status_code == 200 and r.json()["status"] == "ok"
            assert hello_over_websocket(child)["type"] == "hello"
            print(f"new client answered in {time.monotonic() - t0:.2f} s beside 400 silent sockets")
        finally:
            for s in socks:
                s.close()
        assert child.proc.poll() is None
    log = child.log.read_text()
    assert log.count("Traceback") == 0, log[-3000:]
    assert len(log) < 200_000, f"the log grew to {len(log)} bytes"


def test_sockets_that_never_finish_their_request_are_closed(tiny_model_dir: Path, tmp_path: Path) -> None:
    with serve(tiny_model_dir, tmp_path, "--max-seq-len", "512", "--handshake-timeout", "1") as child:
        s = socket.create_connection(("127.0.0.1", child.port), timeout=10)
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        assert s.recv(100) == b""  # closed by the server, not by our timeout
        assert time.monotonic() - t0 < 5
        s.close()
        keep = socket.create_connection(("127.0.0.1", child.port), timeout=10)  # a finished request is not cut
        keep.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert keep.recv(100).startswith(b"HTTP/1.1 200")
        keep.close()


def raw_websocket(port: int) -> socket.socket:
    """A websocket handshake by hand, so that nothing reads what the server sends (a real client library would)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window, a reader that stalls
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


def text_frame(payload: bytes) -> bytes:
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def generate_frame(i: int, max_new_tokens: int = 4000) -> bytes:
    bias = {"0": -100, "1": -100, "2": -100}  # the tiny model's special tokens: no early stop
    return text_frame(json.dumps({"type": "generate", "id": f"g{i}", "alternatives": 20,
                                  "max_new_tokens": max_new_tokens, "messages": [{"role": "user", "content": "hi"}],
                                  "settings": {"token_bias": bias}}).encode())


def wait_released(child: Child) -> dict[str, object]:
    deadline = time.monotonic() + 30
    while True:  # the request is dropped and the KV cache freed with the connection
        health: dict[str, object] = httpx.get(f"{child.url}/healthz", timeout=30).json()
        if health["sessions"] == 0 and health["active"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.5)


def test_a_client_that_floods_without_reading_leaves_rss_flat_and_its_session_released(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with serve(tiny_model_dir, tmp_path, "--max-seq-len", "8192") as child:
        ws = raw_websocket(child.port)
        ws.sendall(generate_frame(0))
        time.sleep(1.0)
        before = child.rss_mb()
        ws.settimeout(0.2)
        junk = text_frame(b"{not json")
        sent, closed, t0 = 0, None, time.monotonic()
        while time.monotonic() - t0 < 10:  # each frame is answered (busy_connection, bad_json)
            try:
                ws.sendall(generate_frame(sent) if sent % 2 else junk)
                sent += 1
            except TimeoutError:
                pass
            except OSError:
                closed = time.monotonic() - t0
                break
        during = child.rss_mb()
        print(f"flood: {sent} frames, closed after {closed} s; server RSS {before:.0f} MB -> {during:.0f} MB")
        assert during - before < 100, (before, during)
        assert closed is not None, f"still open after {sent} invalid frames"
        health = wait_released(child)
        assert health["sessions"] == 0 and health["active"] == 0, health
        ws.close()
        assert "invalid frames in a row" in child.log.read_text()
        assert hello_over_websocket(child)["type"] == "hello"


def test_a_client_that_never_reads_is_closed_after_the_stall_timeout(tiny_model_dir: Path, tmp_path: Path) -> None:
    with serve(tiny_model_dir, tmp_path, "--max-seq-len", "8192", "--stall-timeout", "3") as child:
        ws = raw_websocket(child.port)
        ws.settimeout(1.0)
        closed, t0, i = None, time.monotonic(), 0
        while closed is None and time.monotonic() - t0 < 90:  # valid frames only: stop the reply, ask for another
            try:
                ws.sendall(text_frame(json.dumps({"type": "stop", "id": f"g{i - 1}"}).encode()))
                time.sleep(0.3)
                ws.sendall(generate_frame(i))
                i += 1
                time.sleep(0.3)
            except TimeoutError:
                pass
            except OSError:
                closed = time.monotonic() - t0
        print(f"never-reading client closed after {closed} s and {i} replies")
        assert closed is not None
        health = wait_released(child)
        assert health["sessions"] == 0 and health["active"] == 0, health
        ws.close()
        assert "closing a websocket: replies unread for 3 s" in child.log.read_text()


def test_accept_errors_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    handler = AcceptErrorLog(interval=60)
    loop = asyncio.new_event_loop()
    try:
        for _ in range(500):
            handler(loop, {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many")})
    finally:
        loop.close()
    lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(lines) == 1 and handler.skipped == 499
