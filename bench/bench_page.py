"""What a user of the page gets: the engine's decode speed while Chromium shows the reply, against a plain websocket
client on the same server, and the browser's CPU per token.

On a small machine the browser shares the cores with the model, so every redraw is taken from the forward. One
`webchat serve` on the default model's GGUF; each round asks for the same long story three ways, alternating: through
the page with the heatmap off, with it on, and from a websocket client with no browser (the engine's speed with nothing
drawing). The engine's own decode tok/s comes from each reply's `done.stats`; the browser's CPU is the sum over its
processes (/proc), per generated token.

    .venv/bin/python bench/bench_page.py                  # Debian's /usr/bin/chromium, 3 rounds
    .venv/bin/python bench/bench_page.py --rounds 5 --chromium /path/to/chromium
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import websockets
from playwright.sync_api import Page, WebSocket, sync_playwright

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from bench.bench_served import default_gguf, free_port, webchat_server  # noqa: E402

PROMPT = "Write a long story about a dragon who learns to bake bread."


def browser_cpu_s() -> float:
    """CPU seconds used so far by every chromium process."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"chromium" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]:
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError):
            continue
    return total


class PageRun:
    """The page's websocket frames watched for `done`: the engine's stats of the reply the page asked for."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.done: dict[str, float] | None = None
        page.on("websocket", self._watch)

    def _watch(self, ws: WebSocket) -> None:
        def on_frame(payload: str | bytes) -> None:
            msg = json.loads(payload)
            if msg.get("type") == "done":
                self.done = msg.get("stats") or {}
        ws.on("framereceived", on_frame)

    def ask(self, heatmap: bool, prompt: str) -> tuple[dict[str, float], float]:
        """(the reply's stats, browser CPU seconds while it streamed)."""
        self.page.get_by_test_id("new-chat").click()
        toggle = self.page.get_by_test_id("heatmap-toggle")
        toggle.check() if heatmap else toggle.uncheck()
        self.done = None
        cpu = browser_cpu_s()
        self.page.get_by_test_id("input").fill(prompt)
        self.page.keyboard.press("Enter")
        deadline = time.monotonic() + 300
        while self.done is None and time.monotonic() < deadline:
            self.page.wait_for_timeout(50)
        if self.done is None:
            raise RuntimeError("the page's reply did not finish in 300 s")
        return self.done, browser_cpu_s() - cpu


async def socket_run(port: int, prompt: str) -> dict[str, float]:
    """The same request from a websocket client that draws nothing: the engine's speed with the cores to itself."""
    url, origin = f"ws://127.0.0.1:{port}/ws", f"http://127.0.0.1:{port}"
    async with websockets.connect(url, max_size=None, additional_headers={"Origin": origin}) as ws:
        json.loads(await ws.recv())  # hello
        await ws.send(json.dumps({"type": "generate", "id": "bench", "messages": [{"role": "user", "content": prompt}],
                                  "settings": {"temperature": 0.0}, "alternatives": 5}))
        while True:
            msg = json.loads(await ws.recv())
            if msg["type"] == "done":
                return dict(msg["stats"])
            if msg["type"] == "error":
                raise RuntimeError(f"the socket request failed: {msg}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    gguf = default_gguf().resolve()
    port = free_port()
    server = webchat_server(gguf, port, [], HERE)
    rows: dict[str, list[tuple[float, float, float]]] = {}  # way -> (engine tok/s, tokens, browser CPU ms/token)
    try:
        server.wait_ready()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            run = PageRun(page)  # watching before the page opens its socket
            page.goto(f"http://127.0.0.1:{port}/")
            page.get_by_test_id("input").wait_for()
            run.ask(False, "Say hello.")  # warm-up: the page's first request
            for r in range(args.rounds):
                for way, heatmap in (("page, heatmap off", False), ("page, heatmap on", True)):
                    stats, cpu = run.ask(heatmap, f"{PROMPT} ({r})")
                    n = float(stats["new_tokens"])
                    rows.setdefault(way, []).append((float(stats["decode_tps"]), n, cpu * 1000 / n))
                with ThreadPoolExecutor(1) as pool:  # playwright's sync API holds this thread's event loop
                    stats = pool.submit(asyncio.run, socket_run(port, f"{PROMPT} ({r})")).result()
                rows.setdefault("socket client, no browser", []).append(
                    (float(stats["decode_tps"]), float(stats["new_tokens"]), 0.0))
                print(f"round {r + 1}: " + ", ".join(f"{way} {v[-1][0]:.1f} tok/s" for way, v in rows.items()),
                      flush=True)
            browser.close()
    finally:
        server.stop()
    base = statistics.median(v[0] for v in rows["socket client, no browser"])
    print(f"\n{gguf.name}, the page's default settings (the socket client greedy), {args.rounds} rounds (medians), "
          "ways alternating")
    print("| way | engine decode tok/s | against the socket client | tokens | browser CPU ms / token |")
    print("|---|---:|---:|---:|---:|")
    for way, v in rows.items():
        tps = statistics.median(x[0] for x in v)
        cpu = f"{statistics.median(x[2] for x in v):.2f}" if way.startswith("page") else "-"
        print(f"| {way} | {tps:.1f} | {tps / base:.2f}x | {statistics.median(x[1] for x in v):.0f} | {cpu} |")


if __name__ == "__main__":
    main()
