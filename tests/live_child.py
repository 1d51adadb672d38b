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
from collections.abc import Callable, Iterator
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


def launch(log_path: Path, *args: str, port: int | None = None,
           preexec_fn: Callable[[], None] | None = None) -> tuple[subprocess.Popen[bytes], int]:  # fmt: skip
    """`python -m webchat.cli serve --port P --device cpu *args` from the repository, its output into log_path: the one
    way a test (tests/ and e2e/) starts a server process."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "webchat.cli", "serve", "--port", str(port), "--device", "cpu", *args]
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=preexec_fn,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, port


def wait_healthy(url: str, proc: subprocess.Popen[bytes], ready_s: float, log_text: Callable[[], str],
                 token: str | None = None, stop: Callable[[], str | None] = lambda: None) -> float:  # fmt: skip
    """Seconds until `url`/healthz answered; AssertionError with the log's tail if the process exits, `stop` names a
    reason, or it is not healthy within `ready_s`."""
    t0 = time.monotonic()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    while True:
        reason = stop()
        assert reason is None, reason
        assert proc.poll() is None, f"serve exited {proc.returncode}: {log_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/healthz", timeout=1, headers=headers).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < ready_s, f"serve was not healthy after {ready_s} s: {log_text()[-3000:]}"
        time.sleep(0.1)


def end(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def serve(tmp_path: Path, *args: str, ready_s: float = 180.0, kill_mb: float = 3000.0, token: str | None = None,
          nofile: int | None = None) -> Iterator[Child]:
    """`webchat serve --device cpu --port P *args` (under an open-file limit of `nofile`), its RSS watched; yields
    once /healthz answers, AssertionError (with the log's tail) if it exits, passes `kill_mb` or is not healthy within
    `ready_s` seconds. Stopped (SIGTERM, then SIGKILL after 10 s) at the end."""
    port = free_port()

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc, port = launch(tmp_path / f"serve-{port}.log", *args, port=port, preexec_fn=limit)
    child, done = Child(proc, port, tmp_path / f"serve-{port}.log"), threading.Event()
    watcher = threading.Thread(target=_watch, args=(child, kill_mb, done), daemon=True)
    watcher.start()
    try:
        child.started_s = wait_healthy(child.url, proc, ready_s, child.text, token, lambda: (
            f"serve passed {kill_mb:.0f} MB before it was healthy" if child.killed_for_memory else None))
        yield child
    finally:
        done.set()
        end(proc)


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
