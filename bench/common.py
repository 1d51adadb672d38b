"""What the benches share: one server process on a free port (`webchat serve` or llama-server), waited for until it
answers, the tail of its log in the error when it does not, stopped at the end; the OpenAI streaming client and its
sections (time to first token, decode, aggregate); and the one table format every bench prints (Markdown)."""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from bench.served_prompts import short_chat

ROOT = Path(__file__).resolve().parents[1]  # the checkout these benches belong to
THREADS = 2  # each server's threads: every core of the project's 2-core machines
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Stream:
    """One streamed reply as its client saw it."""

    ttft_ms: float
    tokens: int
    decode_tps: float  # (tokens - 1) / (last content chunk - first): a server that merges chunks is not favoured
    end: float  # perf_counter of the last content chunk
    prompt_tokens: int = 0
    text: str = ""  # the reply's content (a follow-up turn sends it back)


@dataclass
class Section:
    """Streams sent together: aggregate tok/s is all their tokens over the wall from the first request to the last
    token."""

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


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the bench that started it dies (killed, Ctrl-C'd twice), so no server
    is left running to load the next bench's machine (Linux's PR_SET_PDEATHSIG)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


class Server:
    """One server process on one port, started at once: `wait_ready` until `ready_path` answers 200 (or `with`),
    `stop` at the end. Its output is read as it comes and its tail kept for errors (a server that logs more than a
    pipe holds would otherwise stop at its next write). `extra_body` is its own way of biasing end-of-turn away;
    `info_path`'s JSON (webchat's /api/info) is read once it is up; its peak RSS is sampled while it runs."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
                 extra_body: dict[str, object] | None = None, ready_path: str = "/health",
                 cwd: Path | None = None, info_path: str | None = None) -> None:
        self.name, self.port, self.extra_body, self.ready_path = name, port, extra_body or {}, ready_path
        self.info_path = info_path
        self.info: dict[str, Any] = {}
        self.model = "default"  # the id /v1/models gives, once ready
        self.peak_rss = 0
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        self._log: deque[bytes] = deque(maxlen=64)
        threading.Thread(target=self._drain, daemon=True).start()
        self._sampling = True
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)
        self._ready = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
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

    def log_tail(self, chars: int = 2000) -> str:
        return b"".join(self._log).decode(errors="replace")[-chars:]

    def get(self, path: str, timeout: float = 60) -> Any:
        """The JSON a GET of `path` answers."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 600.0) -> Server:
        """Itself once `ready_path` answers 200; stopped, with its log's tail in the error, if it exits first or does
        not answer within `timeout` seconds."""
        if self._ready:
            return self
        try:
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the drain's last lines
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", self.ready_path)
                if conn.getresponse().status == 200:
                    self.model = self.get("/v1/models")["data"][0]["id"]
                    if self.info_path is not None:
                        try:
                            self.info = self.get(self.info_path)
                        except ValueError:  # not JSON: a checkout from before that path
                            self.info = {}
                    self._sampler.start()
                    self._ready = True
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer on port {self.port} within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        self._sampling = False
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Server:
        return self.wait_ready()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def cpu_s(self) -> float:
        """The process's user + system CPU seconds so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stream(self, messages: list[dict[str, str]], tokens: int) -> Stream:
        """One greedy /v1/chat/completions stream of `tokens` tokens (end-of-turn biased away), timed."""
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
        pieces: list[str] = []
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
                pieces.append(choices[0]["delta"]["content"])
        conn.close()
        n = int(usage.get("completion_tokens", chunks))
        if n < 2 or not first:
            raise RuntimeError(f"{self.name}: expected a stream of tokens, got {n} ({chunks} content chunks)")
        decode = (n - 1) / (last - first) if last > first else float("nan")
        return Stream((first - t0) * 1000, n, decode, last, int(usage.get("prompt_tokens", 0)), "".join(pieces))


def parallel(calls: list[Callable[[], T]]) -> list[T]:
    """Each call on a thread of its own, all at once; their results in order (the first failure raised)."""
    results: list[T | BaseException] = [RuntimeError("not run")] * len(calls)

    def one(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - raised below
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise RuntimeError(str(r)) from r
    return results  # type: ignore[return-value]


def concurrent(server: Server, clients: int, tokens: int, offset: int) -> Section:
    """`clients` concurrent streams of short chats (topics offset, offset + 1, ...)."""
    t0 = time.perf_counter()
    try:
        streams = parallel([partial(server.stream, short_chat(offset + i), tokens) for i in range(clients)])
    except RuntimeError as exc:
        raise RuntimeError(f"{server.name}, {clients} clients: {exc}") from exc
    return Section(f"c{clients}", streams, max(s.end for s in streams) - t0)


def webchat_server(port: int, model: Path | None, *args: str, src: Path = ROOT, stops: Sequence[int] = (),
                   exact: bool = False, device: str | None = "cpu", name: str | None = None) -> Server:
    """`webchat serve` from the checkout `src`, run from inside it: `python -m` puts the working directory ahead of
    PYTHONPATH (from another checkout's folder, that checkout's package would be the one served). `stops` are biased
    away (logit_bias -100) so every reply runs to its length; `exact` is issue 38's float32 activations (`--exact`);
    `args` go to `serve` as they are (`--engine-url URL` in place of a model). Its /api/info is read once it is up."""
    argv = [sys.executable, "-m", "webchat.cli", "serve", "--port", str(port)]
    argv += ["--model", str(model)] if model is not None else []
    argv += ["--device", device] if device is not None else []
    argv += [*args, *(["--exact"] if exact else [])]
    body: dict[str, object] = {"logit_bias": {str(t): -100 for t in stops}} if stops else {}
    env = dict(os.environ, PYTHONPATH=str(src))
    name = name or ("webchat --exact" if exact else "webchat")
    return Server(name, argv, port, env, body, "/healthz", cwd=src, info_path="/api/info")


def llama_server(binary: Path, gguf: Path, port: int, ctx: int, parallel: int = 16, *args: str,
                 threads: int = THREADS) -> Server:
    """llama-server on `gguf`, `parallel` slots sharing `ctx` tokens, end of turn ignored; `args` as they are."""
    argv = [str(binary), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", str(threads),
            "-tb", str(threads), "-np", str(parallel), "-c", str(ctx), "--no-webui", *args]
    return Server("llama-server", argv, port, None, {"ignore_eos": True}, "/health")


def built_by(script: str, given: Path | None) -> Path:
    """`given`, else the path bench/<script> prints last (it builds what it names once, then only prints it)."""
    if given is not None:
        return given
    out = subprocess.run(["bash", str(ROOT / "bench" / script)], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def find_llama_server(given: Path | None) -> Path:
    return built_by("build_llama_server.sh", given)


def default_gguf() -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct Q4_1), pulled once."""
    from webchat.files.pull import ensure_default_gguf

    return ensure_default_gguf().resolve()


def default_model() -> Path:
    """The default model's folder, converted once from its GGUF."""
    from webchat.files.pull import ensure_default_model

    return ensure_default_model()


def stop_token_ids(gguf: Path) -> list[int]:
    """The GGUF's end-of-sequence and end-of-turn ids."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    ids = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        f = reader.fields.get(key)
        if f is not None:
            ids.add(int(f.parts[f.data[0]][0]))
    return sorted(ids)


def table_header(*columns: str, align: str = "") -> str:
    """A Markdown table's header; `align` is each column's l(eft) or r(ight), by default the first left, the rest
    right."""
    align = align or "l" + "r" * (len(columns) - 1)
    if len(align) != len(columns):
        raise ValueError(f"align names {len(align)} columns, the header has {len(columns)}")
    return "| " + " | ".join(columns) + " |\n|" + "".join("---|" if a == "l" else "---:|" for a in align)


def table_row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"
