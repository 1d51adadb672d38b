"""A real `webchat serve` child process whose RSS is watched from start to end (issue 42's acceptance: healthy
within its usual start-up time and under a memory ceiling, whatever is in its models folder or upstream). A child
that passes `kill_mb` is killed at once, so a regression cannot take the machine down with it."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Child:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    started_s: float = 0.0  # seconds until /healthz first answered
    peak_mb: float = 0.0
    killed_for_memory: bool = False
    samples: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_mb(self) -> float:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> float:
        """SIGTERM, as a service manager sends it; the seconds it took to exit (AssertionError past `timeout`)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve ignored SIGTERM for {timeout} s: {self.text()[-2000:]}") from None
        return time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _watch(child: Child, kill_mb: float, done: threading.Event) -> None:
    while not done.is_set() and child.proc.poll() is None:
        rss = child.rss_mb()
        child.peak_mb = max(child.peak_mb, rss)
        if rss > kill_mb:
            child.killed_for_memory = True
            child.proc.kill()
            return
        done.wait(0.05)


@contextmanager
def serve(tmp_path: Path, *args: str, ready_s: float = 180.0, kill_mb: float = 3000.0, token: str | None = None,
          nofile: int | None = None) -> Iterator[Child]:
    """`webchat serve --device cpu --port P *args` (under an open-file limit of `nofile`); yields once /healthz
    answers, AssertionError (with the log's tail) if it exits, passes `kill_mb` or is not healthy within `ready_s`
    seconds. Stopped (SIGTERM, then SIGKILL after 10 s) at the end."""
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "webchat.cli", "serve", "--port", str(port), "--device", "cpu", *args]

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=limit,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    child, done = Child(proc, port, log), threading.Event()
    watcher = threading.Thread(target=_watch, args=(child, kill_mb, done), daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        while True:
            assert not child.killed_for_memory, f"serve passed {kill_mb:.0f} MB before it was healthy"
            assert proc.poll() is None, f"serve exited {proc.returncode}: {child.text()[-3000:]}"
            try:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                if httpx.get(f"{child.url}/healthz", timeout=1, headers=headers).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < ready_s, (f"serve was not healthy after {ready_s} s (RSS "
                                                     f"{child.rss_mb():.0f} MB): {child.text()[-3000:]}")
            time.sleep(0.1)
        child.started_s = time.monotonic() - t0
        yield child
    finally:
        done.set()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_watched(cmd: list[str], timeout: float, kill_mb: float) -> subprocess.CompletedProcess[str]:
    """subprocess.run(cmd) from the repository, killed past `timeout` seconds or `kill_mb` MB of RSS (AssertionError
    either way, naming which)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child, done = Child(proc, 0, Path(os.devnull)), threading.Event()
    threading.Thread(target=_watch, args=(child, kill_mb, done), daemon=True).start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{cmd} ran past {timeout} s (RSS {child.peak_mb:.0f} MB at most)") from None
    finally:
        done.set()
    assert not child.killed_for_memory, f"{cmd} passed {kill_mb:.0f} MB"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    """GET /healthz every 50 ms until `stop`, each answer's seconds into `out` (a timeout counts as 5 s)."""
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            httpx.get(f"{url}/healthz", timeout=5).raise_for_status()
            out.append(time.monotonic() - t0)
        except httpx.HTTPError:
            out.append(5.0)
        stop.wait(0.05)
