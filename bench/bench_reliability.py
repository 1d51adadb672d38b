"""Issue 63's hostile requests against a real `webchat serve`, with one core kept busy by another process: for each,
its answer, and what another client saw meanwhile (its longest pause between stream chunks, /healthz's longest
answer); then a ~7,500-token prompt scored (`echo` + `logprobs`) against the same prompt's plain prefill, alternating,
with the server's RSS before and after.

    .venv/bin/python -m bench.bench_reliability [--rows 5,6,7,9] [--no-busy] [--score-tokens 7500] [--pairs 2]

Targets (docs/api.md, "Limits"): every pause and /healthz under 0.5 s; scoring at most 1.3x its plain prefill and
under 200 MB of RSS beyond it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.common import Server, default_model, free_port, table_header, table_row, webchat_server

PAUSE_TARGET_S = 0.5


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def cases() -> dict[str, tuple[str, dict[str, Any]]]:
    """Row and case -> (path, body without the model) for the rows whose pace the issue measures."""
    props = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)},
             "required": [f"p{i}" for i in range(4000)]}
    params = {"type": "object", "properties": {f"a{j}": {"type": "string"} for j in range(60)},
              "required": [f"a{j}" for j in range(60)]}
    hi = [{"role": "user", "content": "Hi"}]
    chat = "/v1/chat/completions"
    return {
        "5 4,000 required properties": (chat, {"messages": hi, "max_tokens": 8,
                                               "response_format": schema_format(props)}),
        "6 a pattern of 20,000 alternatives": (chat, {"messages": hi, "max_tokens": 24, "response_format":
                                                      schema_format({"type": "string", "pattern": "^(" + "|".join(
                                                          f"w{i}x" for i in range(20000)) + ")$"})}),
        "6 regex .*a.{40}": (chat, {"messages": [{"role": "user", "content": "Write aaaa a a aa"}], "max_tokens": 60,
                                    "temperature": 1.0, "structured_outputs": {"regex": ".*a.{40}"}}),
        "6 regex (a{1000}){1000}": (chat, {"messages": hi, "max_tokens": 16,
                                           "structured_outputs": {"regex": "(a{1000}){1000}"}}),
        "6 an enum of 12,000": (chat, {"messages": hi, "max_tokens": 16, "response_format": schema_format(
            {"enum": [f"value {i}" for i in range(12000)]})}),
        "9 128 tools x 60 required parameters": (chat, {"messages": hi, "max_tokens": 8, "tools": [
            {"type": "function", "function": {"name": f"t{i}", "parameters": params}} for i in range(128)]}),
    }


class Watch:
    """Another client's stream, looping, and a /healthz poller: what they saw, timestamped."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.gaps: list[tuple[float, float]] = []  # (when, seconds since the chunk before)
        self.health: list[tuple[float, float]] = []  # (when asked, seconds to answer)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._stream, daemon=True),
                         threading.Thread(target=self._poll, daemon=True)]

    def __enter__(self) -> Watch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _stream(self) -> None:
        body = {"model": self.server.model, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 400, "temperature": 0.8, "stream": True}
        while not self._stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=600)
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            last = None
            for raw in conn.getresponse():
                if self._stop.is_set():
                    break
                if raw.startswith(b"data: {"):
                    now = time.monotonic()
                    if last is not None:
                        self.gaps.append((now, now - last))
                    last = now
            conn.close()

    def _poll(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=60)
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            conn.close()
            self.health.append((t, time.monotonic() - t))
            time.sleep(0.1)

    def worst(self, t0: float, t1: float) -> tuple[float, float]:
        """(longest chunk gap, longest /healthz) between t0 and t1."""
        gap = max((g for t, g in self.gaps if t0 <= t <= t1), default=float("nan"))
        health = max((h for t, h in self.health if t0 <= t <= t1), default=float("nan"))
        return gap, health


def post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=900)
    conn.request("POST", path, json.dumps({"model": server.model, **body}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data.startswith(b"{") else {}


def timed(fn: Callable[[], tuple[int, dict[str, Any]]]) -> tuple[float, float, int, dict[str, Any]]:
    t0 = time.monotonic()
    status, body = fn()
    return t0, time.monotonic(), status, body


def scoring_prompt(server: Server, tokens: int) -> str:
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * (tokens // 10)
    count = post(server, "/tokenize", {"prompt": text})[1]["count"]
    return text[: int(len(text) * tokens / count)]


def rss_mb(server: Server) -> float:
    with open(f"/proc/{server.proc.pid}/statm") as f:
        return int(f.read().split()[1]) * 4096 / (1 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="5,6,7,9", help="rows of issue 63 to run (5, 6, 7, 9)")
    parser.add_argument("--no-busy", action="store_true", help="leave both cores to the server")
    parser.add_argument("--score-tokens", type=int, default=7500)
    parser.add_argument("--pairs", type=int, default=2, help="plain / scored pairs, alternating")
    args = parser.parse_args()
    rows = set(args.rows.split(","))
    busy = None if args.no_busy else subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with webchat_server(free_port(), default_model()).wait_ready() as server, Watch(server) as watch:
            time.sleep(5)
            print(f"busy core: {'no' if busy is None else 'yes'}; another client's stream and /healthz watched\n")
            print(table_header("row and request", "status", "s", "longest pause s", "longest /healthz s",
                               align="llrrr"))
            t0 = time.monotonic()
            time.sleep(10)
            gap, health = watch.worst(t0, time.monotonic())
            print(table_row("(nothing else, 10 s)", "", "10.00", f"{gap:.2f}", f"{health:.2f}"), flush=True)
            for name, (path, body) in cases().items():
                if name.split()[0] not in rows:
                    continue
                t0, t1, status, reply = timed(lambda p=path, b=body: post(server, p, b))
                gap, health = watch.worst(t0, t1)
                code = reply.get("error", {}).get("code", "") if status != 200 else ""
                print(table_row(name, f"{status} {code}".strip(), f"{t1 - t0:.2f}", f"{gap:.2f}", f"{health:.2f}"),
                      flush=True)
            print(f"\nthe device's team now: {server.get('/api/info').get('device_threads')}", flush=True)
            if "7" in rows:
                score(server, watch, args.score_tokens, args.pairs)
    finally:
        if busy is not None:
            busy.kill()


def score(server: Server, watch: Watch, tokens: int, pairs: int) -> None:
    """Row 7: the same prompt prefilled plain (max_tokens 1) and scored (echo + logprobs 5, max_tokens 0), in turn."""
    prompt = scoring_prompt(server, tokens)
    print(f"\nrow 7: a {tokens}-token prompt, plain prefill and scored, alternating\n")
    print(table_header("request", "s", "longest pause s", "longest /healthz s", "RSS before MiB", "RSS after MiB"))
    ratios, beyond = [], []
    for i in range(pairs):
        plain_s = plain_rise = 0.0
        for kind in ("plain", "scored"):
            body = {"prompt": f"Take {i} ({kind}). " + prompt, "max_tokens": 1 if kind == "plain" else 0}
            if kind == "scored":
                body.update(echo=True, logprobs=5)
            before = rss_mb(server)
            t0, t1, status, _ = timed(lambda b=body: post(server, "/v1/completions", b))
            gap, health = watch.worst(t0, t1)
            after = rss_mb(server)
            print(table_row(f"{kind} ({status})", f"{t1 - t0:.1f}", f"{gap:.2f}", f"{health:.2f}", f"{before:.0f}",
                            f"{after:.0f}"), flush=True)
            if kind == "plain":
                plain_s, plain_rise = t1 - t0, after - before
            else:
                ratios.append((t1 - t0) / plain_s)
                beyond.append((after - before) - plain_rise)
    print(f"\nscored / plain: {', '.join(f'{r:.2f}' for r in ratios)} (target at most 1.3)")
    # Both prompts are new to the cache, so each writes its own KV pages: the pool's pages are resident once written
    # (a 1 GiB pool on the CPU, as llama-server holds its whole cache), the same for a plain prefill and a scored one.
    # What scoring itself holds is its rise beyond the plain prefill's.
    print(f"scored RSS rise beyond the plain prefill's: {', '.join(f'{b:+.0f} MiB' for b in beyond)} "
          f"(target under 200)")


if __name__ == "__main__":
    main()
