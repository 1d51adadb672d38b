"""House style, checked: ruff at 120 columns on everything, mypy --strict on the package and the kernels' launchers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_is_clean() -> None:
    proc = run("ruff", "check", "webchat", "bench", "tests", "e2e")
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_mypy_strict_is_clean() -> None:
    proc = run("mypy", "webchat")
    assert proc.returncode == 0, proc.stdout[-3000:]
