"""How soon a Stop (and a disconnect) reaches an upstream engine: `webchat serve --engine-url` in front of another
`webchat serve` (the tiny random model on the CPU, or --model DIR), both real processes on loopback.

For each trial: a websocket to the front asks for a long reply; after a few chunks it sends `stop` (or closes the
socket) at t0; printed are the time to the front's `done` and the time until the upstream's /api/info shows no active
request (polled every 2 ms). The same Stop sent to the upstream's own websocket is the baseline.

    .venv/bin/python bench/bench_remote_stop.py [--trials 20] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "webchat.cli", "serve", "--port", str(port), *args],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"webchat serve exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"webchat serve did not start: {log.read_text()[-2000:]}")


def active(upstream: str) -> int:
    return int(httpx.get(f"{upstream}/api/info", timeout=5).json()["active"])


def trial(front: str, upstream: str, how: str) -> tuple[float, float | None]:
    """(ms to the upstream's active count 0, ms to the front's `done`; None for a disconnect)."""
    with connect(front.replace("http://", "ws://") + "/ws") as ws:
        json.loads(ws.recv(10))
        ws.send(json.dumps({"type": "generate", "id": "s", "max_new_tokens": 4000, "alternatives": 5,
                            "messages": [{"role": "user", "content": "Tell a long story."}], "stop": ["\u2603"]}))
        chunks = 0
        while chunks < 5:
            if json.loads(ws.recv(30))["type"] == "chunk":
                chunks += 1
        t0 = time.perf_counter()
        done_ms = None
        if how == "stop":
            ws.send(json.dumps({"type": "stop", "id": "s"}))
            while json.loads(ws.recv(30))["type"] != "done":
                pass
            done_ms = (time.perf_counter() - t0) * 1000
        else:
            ws.close()
        while active(upstream):
            time.sleep(0.002)
        zero_ms = (time.perf_counter() - t0) * 1000
    return zero_ms, done_ms


def summary(name: str, values: list[float]) -> str:
    return (f"{name:<44} median {statistics.median(values):7.1f} ms   p90 "
            f"{sorted(values)[int(0.9 * (len(values) - 1))]:7.1f} ms   max {max(values):7.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--model", type=Path, default=None, help="upstream model folder (default: a tiny random model)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="remote-stop-"))
    model = args.model
    if model is None:
        from webchat.tiny import make_tiny_model

        model = tmp / "tiny"
        make_tiny_model(model, max_seq_len=8192)
    up_proc, upstream = start(["--model", str(model), "--device", "cpu"], tmp / "upstream.log")
    front_proc, front = start(["--engine-url", upstream], tmp / "front.log")
    try:
        rows: dict[str, list[float]] = {k: [] for k in ("direct", "remote", "remote_done", "disconnect")}
        for _ in range(args.trials):
            rows["direct"].append(trial(upstream, upstream, "stop")[0])
            zero, done = trial(front, upstream, "stop")
            rows["remote"].append(zero)
            rows["remote_done"].append(done or 0.0)
            rows["disconnect"].append(trial(front, upstream, "disconnect")[0])
        print(f"upstream: webchat on {model.name} (CPU), {args.trials} trials each, Stop sent after 5 chunks")
        print(summary("Stop on the upstream's own websocket → active 0", rows["direct"]))
        print(summary("Stop through --engine-url → front's done", rows["remote_done"]))
        print(summary("Stop through --engine-url → upstream active 0", rows["remote"]))
        print(summary("Disconnect from the front → upstream active 0", rows["disconnect"]))
    finally:
        for proc in (front_proc, up_proc):
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
