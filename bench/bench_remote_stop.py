"""How soon a Stop (and a disconnect) reaches an upstream engine: `webchat serve --engine-url` in front of another
`webchat serve` (the tiny random model on the CPU, or --model DIR), both real processes on loopback.

For each trial: a websocket to the front asks for a long reply; after a few chunks it sends `stop` (or closes the
socket) at t0; printed are the time to the front's `done` and the time until the upstream's /api/info shows no active
request (polled every 2 ms). The same Stop sent to the upstream's own websocket is the baseline.

    .venv/bin/python -m bench.bench_remote_stop [--trials 20] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from websockets.sync.client import connect

from bench.common import Server, free_port, table_header, table_row, webchat_server


def active(upstream: Server) -> int:
    return int(upstream.get("/api/info", timeout=5)["active"])


def trial(front: Server, upstream: Server, how: str) -> tuple[float, float | None]:
    """(ms to the upstream's active count 0, ms to the front's `done`; None for a disconnect)."""
    with connect(front.url.replace("http://", "ws://") + "/ws") as ws:
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
    p90 = sorted(values)[int(0.9 * (len(values) - 1))]
    return table_row(name, f"{statistics.median(values):.1f}", f"{p90:.1f}", f"{max(values):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--model", type=Path, default=None, help="upstream model folder (default: a tiny random model)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="remote-stop-") as tmp:
        model = args.model
        if model is None:
            from bench.tiny import make_tiny_model

            model = make_tiny_model(Path(tmp) / "tiny", max_seq_len=8192)
        up_port, front_port = free_port(), free_port()
        with (webchat_server(up_port, model, name="upstream") as upstream,
              webchat_server(front_port, None, "--engine-url", upstream.url, device=None, name="front") as front):
            rows: dict[str, list[float]] = {k: [] for k in ("direct", "remote", "remote_done", "disconnect")}
            for _ in range(args.trials):
                rows["direct"].append(trial(upstream, upstream, "stop")[0])
                zero, done = trial(front, upstream, "stop")
                rows["remote"].append(zero)
                rows["remote_done"].append(done or 0.0)
                rows["disconnect"].append(trial(front, upstream, "disconnect")[0])
    print(f"upstream: webchat on {model.name} (CPU), {args.trials} trials each, Stop sent after 5 chunks")
    print(table_header("from Stop (or the disconnect) to", "median ms", "p90 ms", "max ms"))
    print(summary("Stop on the upstream's own websocket → active 0", rows["direct"]))
    print(summary("Stop through --engine-url → front's done", rows["remote_done"]))
    print(summary("Stop through --engine-url → upstream active 0", rows["remote"]))
    print(summary("Disconnect from the front → upstream active 0", rows["disconnect"]))

if __name__ == "__main__":
    main()
