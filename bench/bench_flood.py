"""Server memory under a websocket client that floods frames and never reads (issue 12): RSS before and after.

`webchat serve` runs as a child process (any checkout: `--repo`, `--python`) on a tiny random model; the client does
the websocket handshake by hand on a raw socket (a client library would read in the background), asks for one long
reply with 20 alternatives per token, then for `--seconds` sends frames without reading: odd ones `generate` (each
answered `busy_connection` while the reply runs), even ones invalid JSON (`--junk-only`: all invalid JSON).
Prints the frames it got through, the
server's RSS before, at the end of the flood and at its peak, and whether (and how soon) the server closed it.
Run: `.venv/bin/python bench/bench_flood.py` (compare: `--repo /work/main --python /work/main/.venv/bin/python`).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def frame(payload: bytes) -> bytes:
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def handshake(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    if not head.startswith(b"HTTP/1.1 101"):
        raise RuntimeError(f"handshake refused: {head[:200]!r}")
    return s


def generate(i: int) -> bytes:
    bias = {"0": -100, "1": -100, "2": -100}  # the tiny model's special tokens: the reply runs to max_new_tokens
    return frame(json.dumps({"type": "generate", "id": f"g{i}", "alternatives": 20, "max_new_tokens": 4000,
                             "messages": [{"role": "user", "content": "hi"}],
                             "settings": {"token_bias": bias}}).encode())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose server runs (default: this one)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--junk-only", action="store_true", help="flood with invalid JSON only (no generate frames)")
    args = ap.parse_args()
    from webchat.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", max_seq_len=8192)
        port = free_port()
        log = (Path(tmp) / "serve.log").open("wb")
        proc = subprocess.Popen([args.python, "-m", "webchat.cli", "serve", "--model", str(model), "--port", str(port),
                                 "--device", "cpu", "--max-seq-len", "8192"], cwd=args.repo, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)
            ws = handshake(port)
            ws.sendall(generate(0))
            time.sleep(1.0)
            before = peak = rss_mb(proc.pid)
            ws.settimeout(0.2)
            junk = frame(b"{")
            sent, closed_at, t0 = 0, None, time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                try:
                    ws.sendall(generate(sent) if sent % 2 and not args.junk_only else junk)
                    sent += 1
                except TimeoutError:
                    pass
                except OSError:  # closed by the server
                    closed_at = time.monotonic() - t0
                    break
                if sent % 500 == 0:
                    peak = max(peak, rss_mb(proc.pid))
            end = rss_mb(proc.pid)
            health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
            ws.close()
        finally:
            proc.terminate()
            proc.wait(10)
            log.close()
    closed = f"closed by the server after {closed_at:.1f} s" if closed_at is not None else "never closed"
    print(f"repo {args.repo}: {sent} frames sent (flood of at most {args.seconds:g} s); server RSS {before:.0f} MB "
          f"before, {end:.0f} MB at the end (+{end - before:.0f} MB), peak {max(peak, end):.0f} MB; {closed}; "
          f"/healthz after: {health}")


if __name__ == "__main__":
    main()
