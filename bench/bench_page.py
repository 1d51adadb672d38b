"""What a user of the page gets: the engine's decode speed while Chromium shows the reply, against a plain client on
the same server, and the browser's CPU per token; with --peer, the same for llama.cpp's own web UI on llama-server.

On a small machine the browser shares the cores with the model, so every redraw is taken from the forward. Each round
starts `webchat serve` on the default model's GGUF alone and asks for the same long story three ways: through the
page with the heatmap off, with it on, and from a websocket client with no browser (the engine's speed with nothing
drawing). With --peer, the round then starts llama-server alone on the same GGUF, serving llama.cpp's web UI (the
page its users open at /, built by bench/build_llama_ui.sh), and asks through that page and from an API client with
no browser. Each page runs on its own defaults (sampling, Markdown), both capped at 512 new tokens. The engine's
decode tok/s comes from the server's own figures (webchat's `done.stats`, llama-server's `timings`); the browser's CPU
is the sum over its processes (/proc), per generated token.

    .venv/bin/python -m bench.bench_page                  # Debian's /usr/bin/chromium, 3 rounds
    .venv/bin/python -m bench.bench_page --peer --rounds 2   # and llama.cpp's web UI beside it
    .venv/bin/python -m bench.bench_page --long --rounds 2   # one long reply: the browser's CPU as it grows
    .venv/bin/python -m bench.bench_page --rounds 5 --chromium /path/to/chromium
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import websockets
from playwright.sync_api import Browser, Page, Request, WebSocket, sync_playwright

from bench.common import (
    THREADS,
    Server,
    built_by,
    default_gguf,
    find_llama_server,
    free_port,
    table_header,
    table_row,
    webchat_server,
)

PROMPT = "Write a long story about a dragon who learns to bake bread."
MAX_TOKENS = 512  # the page's default cap on new tokens; llama.cpp's web UI is given the same


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
        self.tokens = 0  # tokens of the reply received so far
        self.marks: list[tuple[float, int, float]] = []  # (time, tokens, browser CPU s) every 250 ms of the reply
        page.on("websocket", self._watch)

    def _watch(self, ws: WebSocket) -> None:
        def on_frame(payload: str | bytes) -> None:
            msg = json.loads(payload)
            if msg.get("type") == "chunk":
                self.tokens += len(msg.get("tokens") or [])
            elif msg.get("type") == "done":
                self.done = msg.get("stats") or {}
        ws.on("framereceived", on_frame)

    def ask(self, heatmap: bool, prompt: str) -> tuple[dict[str, float], float]:
        """(the reply's stats, browser CPU seconds while it streamed)."""
        self.page.get_by_test_id("new-chat").click()
        toggle = self.page.get_by_test_id("heatmap-toggle")
        toggle.check() if heatmap else toggle.uncheck()
        self.done, self.tokens, self.marks = None, 0, []
        cpu = browser_cpu_s()
        self.page.get_by_test_id("input").fill(prompt)
        self.page.keyboard.press("Enter")
        deadline = time.monotonic() + 300
        while self.done is None and time.monotonic() < deadline:
            if not self.marks or time.perf_counter() - self.marks[-1][0] >= 0.25:
                self.marks.append((time.perf_counter(), self.tokens, browser_cpu_s()))
            self.page.wait_for_timeout(50)
        self.marks.append((time.perf_counter(), self.tokens, browser_cpu_s()))
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


class LlamaPage:
    """llama.cpp's web UI: a new chat for each question, its reply's `timings` read from the finished stream."""

    def __init__(self, page: Page, url: str) -> None:
        self.page, self.url = page, url
        self.timings: dict[str, float] | None = None
        page.on("requestfinished", self._finished)

    def _finished(self, request: Request) -> None:
        response = request.response()
        if not request.url.endswith("/v1/chat/completions") or response is None:
            return
        chunks = [line[6:] for line in response.body().decode().splitlines() if line.startswith("data: {")]
        last = json.loads(chunks[-1]) if chunks else {}
        if "timings" not in last:
            raise RuntimeError(f"llama.cpp's web UI: no timings in the stream's last chunk: {str(last)[:300]}")
        self.timings = last["timings"]

    def ask(self, prompt: str) -> tuple[dict[str, float], float]:
        """(llama-server's timings of the reply, browser CPU seconds while it streamed)."""
        self.page.goto(self.url)  # a new chat
        box = self.page.locator("textarea").first
        box.wait_for()
        self.timings = None
        cpu = browser_cpu_s()
        box.fill(prompt)
        self.page.keyboard.press("Enter")
        deadline = time.monotonic() + 300
        while self.timings is None and time.monotonic() < deadline:
            self.page.wait_for_timeout(50)
        if self.timings is None:
            raise RuntimeError("llama.cpp's web UI: the reply did not finish in 300 s")
        return self.timings, browser_cpu_s() - cpu


def llama_api_run(port: int, prompt: str) -> dict[str, float]:
    """The same question to llama-server's API from a client that draws nothing: its `timings`."""
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": MAX_TOKENS}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    timings: dict[str, float] = {}
    for raw in resp:
        if raw.startswith(b"data: {"):
            timings = json.loads(raw[6:]).get("timings", timings)
    conn.close()
    if not timings:
        raise RuntimeError(f"llama-server: HTTP {resp.status}, no timings in the stream")
    return timings


def llama_ui_server(binary: Path, ui: Path, gguf: Path, port: int) -> Server:
    """llama-server as its users start it, serving the web UI from `ui`, its new-token cap set to the page's."""
    argv = [str(binary), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", str(THREADS),
            "-tb", str(THREADS), "--path", str(ui), "--ui-config", json.dumps({"max_tokens": MAX_TOKENS})]
    return Server("llama-server", argv, port, None, None, "/health")


Row = tuple[float, float, float]  # (engine decode tok/s, new tokens, browser CPU ms a token)


def open_page(browser: Browser, port: int, settings: dict[str, str] | None = None) -> tuple[Page, PageRun]:
    """webchat's page on `port` (with `settings` stored first, as the settings panel keeps them), its first request
    answered (a warm-up)."""
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    if settings is not None:
        page.add_init_script(f"localStorage.setItem('webchat.settings.v1', {json.dumps(json.dumps(settings))})")
    run = PageRun(page)  # watching before the page opens its socket
    page.goto(f"http://127.0.0.1:{port}/")
    page.get_by_test_id("input").wait_for()
    run.ask(False, "Say hello.")
    return page, run


def webchat_round(browser: Browser, gguf: Path, r: int, rows: dict[str, list[Row]]) -> None:
    """`webchat serve` alone: the page with the heatmap off and on, then the websocket client."""
    port = free_port()
    server = webchat_server(port, gguf)
    try:
        server.wait_ready()
        page, run = open_page(browser, port)
        for way, heatmap in (("webchat page, heatmap off", False), ("webchat page, heatmap on", True)):
            stats, cpu = run.ask(heatmap, f"{PROMPT} ({r})")
            n = float(stats["new_tokens"])
            rows.setdefault(way, []).append((float(stats["decode_tps"]), n, cpu * 1000 / n))
        page.close()
        with ThreadPoolExecutor(1) as pool:  # playwright's sync API holds this thread's event loop
            stats = pool.submit(asyncio.run, socket_run(port, f"{PROMPT} ({r})")).result()
        rows.setdefault("webchat socket client, no browser", []).append(
            (float(stats["decode_tps"]), float(stats["new_tokens"]), 0.0))
    finally:
        server.stop()


def llama_round(browser: Browser, binary: Path, ui: Path, gguf: Path, r: int, rows: dict[str, list[Row]]) -> None:
    """llama-server alone: llama.cpp's web UI, then its API from a client with no browser."""
    port = free_port()
    server = llama_ui_server(binary, ui, gguf, port)
    try:
        server.wait_ready()
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        run = LlamaPage(page, f"http://127.0.0.1:{port}/")
        run.ask("Say hello.")  # warm-up
        t, cpu = run.ask(f"{PROMPT} ({r})")
        n = float(t["predicted_n"])
        rows.setdefault("llama.cpp web UI", []).append((float(t["predicted_per_second"]), n, cpu * 1000 / n))
        page.close()
        t = llama_api_run(port, f"{PROMPT} ({r})")
        rows.setdefault("llama-server API client, no browser", []).append(
            (float(t["predicted_per_second"]), float(t["predicted_n"]), 0.0))
    finally:
        server.stop()


LONG_TOKENS, WINDOW = 1536, 256
LONG_PROMPT = "Write a very long story about a dragon who learns to bake bread, with many chapters."


def windows(marks: list[tuple[float, int, float]]) -> list[tuple[float, float]]:
    """(page tok/s, browser CPU ms a token) over each WINDOW tokens of a reply, from PageRun.marks."""
    out = []
    for lo in range(0, LONG_TOKENS, WINDOW):
        w = [m for m in marks if lo <= m[1] <= lo + WINDOW]
        if len(w) >= 2 and w[-1][1] > w[0][1]:
            n = w[-1][1] - w[0][1]
            out.append((n / (w[-1][0] - w[0][0]), (w[-1][2] - w[0][2]) * 1000 / n))
    return out


def long_round(browser: Browser, gguf: Path) -> tuple[float, list[tuple[float, float]]]:
    """One greedy reply of LONG_TOKENS through the page (heatmap off): the small model repeats itself into one long
    paragraph, which the browser lays out whole at each flush. (engine decode tok/s, windows)."""
    port = free_port()
    server = webchat_server(port, gguf)
    try:
        server.wait_ready()
        page, run = open_page(browser, port, {"max_new_tokens": str(LONG_TOKENS), "temperature": "0"})
        stats, _ = run.ask(False, LONG_PROMPT)
        page.close()
        return float(stats["decode_tps"]), windows(run.marks)
    finally:
        server.stop()


def main_long(browser: Browser, gguf: Path, rounds: int) -> None:
    got = []
    for r in range(rounds):
        got.append(long_round(browser, gguf))
        print(f"round {r + 1}: engine decode {got[-1][0]:.1f} tok/s", flush=True)
    print(f"\n{gguf.name}, one greedy reply of {LONG_TOKENS} tokens through the page (heatmap off), {rounds} rounds "
          f"(medians); engine decode {statistics.median(g[0] for g in got):.1f} tok/s")
    print(table_header("tokens", "at the page tok/s", "browser CPU ms / token"))
    for i in range(min(len(g[1]) for g in got)):
        tps = statistics.median(g[1][i][0] for g in got)
        cpu = statistics.median(g[1][i][1] for g in got)
        print(table_row(f"{i * WINDOW}-{(i + 1) * WINDOW}", f"{tps:.1f}", f"{cpu:.2f}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--peer", action="store_true", help="llama.cpp's web UI on llama-server too, alternating")
    ap.add_argument("--llama-server", type=Path, default=None, help="binary (default: bench/build_llama_server.sh)")
    ap.add_argument("--llama-ui", type=Path, default=None, help="its built web UI (default: bench/build_llama_ui.sh)")
    ap.add_argument("--long", action="store_true",
                    help=f"only a {LONG_TOKENS}-token greedy reply, the browser's CPU a token as it grows")
    args = ap.parse_args()
    gguf = default_gguf()
    want_peer = args.peer and not args.long
    peer = (find_llama_server(args.llama_server), built_by("build_llama_ui.sh", args.llama_ui)) if want_peer else None
    rows: dict[str, list[Row]] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
        if args.long:
            main_long(browser, gguf, args.rounds)
        else:
            for r in range(args.rounds):
                webchat_round(browser, gguf, r, rows)
                if peer is not None:
                    llama_round(browser, *peer, gguf, r, rows)
                print(f"round {r + 1}: " + ", ".join(f"{way} {v[-1][0]:.1f} tok/s" for way, v in rows.items()),
                      flush=True)
        browser.close()
    if args.long:
        return
    base = {"webchat": statistics.median(v[0] for v in rows["webchat socket client, no browser"])}
    if peer is not None:
        base["llama"] = statistics.median(v[0] for v in rows["llama-server API client, no browser"])
    clients = "webchat's greedy, llama-server's on its own defaults" if peer is not None else "greedy"
    print(f"\n{gguf.name}, each page on its defaults (at most {MAX_TOKENS} new tokens; the client without a browser "
          f"{clients}), {args.rounds} rounds (medians), servers one at a time")
    print(table_header("way", "engine decode tok/s", "against its server's client, no browser", "tokens",
                       "browser CPU ms / token"))
    medians: dict[str, float] = {}
    for way, v in rows.items():
        tps = medians[way] = statistics.median(x[0] for x in v)
        own = base["llama" if way.startswith("llama") else "webchat"]
        cpu = f"{statistics.median(x[2] for x in v):.2f}" if "client" not in way else "-"
        print(table_row(way, f"{tps:.1f}", f"{tps / own:.2f}x", f"{statistics.median(x[1] for x in v):.0f}", cpu))
    if peer is not None:
        ui = medians["llama.cpp web UI"]
        off, on = medians["webchat page, heatmap off"] / ui, medians["webchat page, heatmap on"] / ui
        print(f"webchat's page against llama.cpp's web UI, engine decode while each draws: heatmap off {off:.2f}x, "
              f"heatmap on {on:.2f}x")


if __name__ == "__main__":
    main()
