"""Fixtures of the MCP tests: an HTTP tool server per test, a marker file a tool writes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp_helpers import HttpToolServer


@pytest.fixture
def http_server() -> Iterator[HttpToolServer]:
    server = HttpToolServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """A file a tool writes to say it started, or was cancelled."""
    return tmp_path / "marker"
