"""The README's commands are the ones CI runs, so a missing install step fails in CI and not on a user's machine."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_opens_with_the_run_and_test_commands() -> None:
    run, test = readme_commands()[:2]
    assert run.startswith("bash scripts/setup.sh") and "webchat serve" in run
    assert test.startswith("bash scripts/setup.sh --test") and "pytest" in test


def test_ci_runs_the_readme_test_command() -> None:
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci_lines
