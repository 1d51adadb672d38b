"""One server process and the OpenAI streams a client sends it, for bench/bench_served.py and the benches built on it:
the chats (short stories by topic, one ~1,000-token prompt), a stream's TTFT and decode, a section of streams, the
process's peak RSS sampled while it runs, and what /api/info says where the server has it (webchat's precision)."""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOPICS = ["a lighthouse keeper", "a city under the sea", "a robot gardener", "the last train home", "a winter market",
          "a lost violin", "two rival bakers", "a map with no names", "a comet over the desert", "a library at night",
          "a ship in a bottle", "the mountain post office", "a clockmaker's apprentice", "a river that ran uphill",
          "a festival of lanterns", "an orchard in the fog"]
LONG_PARAGRAPH = (
    "Here are my notes from the meeting. We discussed the quarterly roadmap, the hiring plan for the platform team, "
    "the migration of the billing service to the new database cluster, and the incident from last Tuesday when the "
    "cache layer returned stale prices for about forty minutes. The action items were: write a postmortem, add an "
    "alert on cache age, review the rollout checklist, and schedule a load test before the holiday freeze. ")


def short_chat(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]


def long_chat() -> list[dict[str, str]]:
    text = " ".join(f"Meeting {k + 1}. {LONG_PARAGRAPH}" for k in range(10))  # ~1,000 tokens with either tokenizer
    return [{"role": "user", "content": text + "Summarise these notes as a short list of decisions."}]


@dataclass
class Stream:
    ttft_ms: float
    tokens: int
    decode_tps: float
    end: float  # perf_counter of the last content chunk
    prompt_tokens: int = 0


@dataclass
class Section:
    name: str
    streams: list[Stream]
    wall_s: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def aggregate(self) -> float:
        return sum(s.tokens for s in self.streams) / self.wall_s

    @property
    def decode_median(self) -> float:
        return statistics.median(s.decode_tps for s in self.streams)

    @property
    def decode_min(self) -> float:
        return min(s.decode_tps for s in self.streams)

    @property
    def ttft_median(self) -> float:
        return statistics.median(s.ttft_ms for s in self.streams)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """One server process on one port; `body` adds its own way of biasing end-of-turn away."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
                 extra_body: dict[str, object] | None = None, ready_path: str = "/health",
                 cwd: Path | None = None, info_path: str | None = None) -> None:
        self.name, self.port, self.extra_body, self.ready_path = name, port, extra_body or {}, ready_path
        self.info_path = info_path
        self.info: dict[str, Any] = {}  # the JSON at info_path once ready (webchat's /api/info)
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # the log read as it comes, its end kept for errors: a server that logs more than the pipe holds (64 KB;
        # llama-server logs every request) would otherwise stop at its next write
        self._log: deque[bytes] = deque(maxlen=64)
        threading.Thread(target=self._drain, daemon=True).start()
        self.peak_rss = 0
        self.model = "default"
        self._sampling = True
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._log.append(line)

    def _sample_rss(self) -> None:
        status = Path(f"/proc/{self.proc.pid}/status")
        while self._sampling:
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        self.peak_rss = max(self.peak_rss, int(line.split()[1]) * 1024)
            except OSError:
                return
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the drain's last lines
                err = b"".join(self._log).decode(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{err}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", self.ready_path)
                if conn.getresponse().status == 200:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                    conn.request("GET", "/v1/models")
                    self.model = json.loads(conn.getresponse().read())["data"][0]["id"]
                    if self.info_path is not None:
                        conn.request("GET", self.info_path)
                        self.info = json.loads(conn.getresponse().read())
                    self._sampler.start()
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer on port {self.port} within {timeout:.0f} s")

    def stop(self) -> None:
        self._sampling = False
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def stream(self, messages: list[dict[str, str]], tokens: int) -> Stream:
        body = {"model": self.model, "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **self.extra_body}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{self.name}: HTTP {resp.status}: {resp.read()[:300]!r}")
        first = last = 0.0
        chunks = 0
        usage: dict[str, int] = {}
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                last = time.perf_counter()
                first = first or last
                chunks += 1
        conn.close()
        n = int(usage.get("completion_tokens", chunks))
        if n < 2 or not first:
            raise RuntimeError(f"{self.name}: expected a stream of tokens, got {n} ({chunks} content chunks)")
        decode = (n - 1) / (last - first) if last > first else float("nan")
        return Stream((first - t0) * 1000, n, decode, last, int(usage.get("prompt_tokens", 0)))


def concurrent(server: Server, clients: int, tokens: int, offset: int) -> Section:
    results: list[Stream | BaseException] = [RuntimeError("not run")] * clients

    def one(i: int) -> None:
        try:
            results[i] = server.stream(short_chat(offset + i), tokens)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    streams = []
    for r in results:
        if isinstance(r, BaseException):
            raise RuntimeError(f"{server.name}, {clients} clients: {r}") from r
        streams.append(r)
    return Section(f"c{clients}", streams, max(s.end for s in streams) - t0)


