"""The MCP client on a real streamable HTTP server (tests/mcp/toolserver.py under uvicorn on a loopback port): headers,
calls, the limits, and a server that dies mid-call and comes back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from mcp_helpers import HttpToolServer, config, read, started, until
from toolserver import HTML

from webchat.mcp.manager import McpManager
from webchat.mcp.result import ToolCallError
from webchat.mcp.transport import MAX_MESSAGE_BYTES


def test_tools_are_listed_and_called_with_the_configured_headers(http_server: HttpToolServer) -> None:
    entry = {"url": http_server.url, "headers": {"X-Api-Key": "k-123"}}

    async def scenario() -> None:
        async with McpManager(config({"remote": entry})) as manager:
            await started(manager)
            [status] = manager.status()
            assert (status.transport, status.state, status.tool_count) == ("http", "ready", 11)
            assert manager.tools()[0].qualified_name == "remote__add"
            assert (await manager.call("remote__add", {"a": 2, "b": 3})).text == "5"
            assert (await manager.call("remote__header", {"name": "X-Api-Key"})).text == "k-123"
            html = await manager.call("remote__html", {})
            assert (html.text, html.media_type) == (HTML, "text/plain")

    asyncio.run(scenario())


def test_a_call_past_its_time_limit_is_a_timeout_and_the_server_is_told(http_server: HttpToolServer,
                                                                         marker: Path) -> None:
    async def scenario() -> None:
        async with McpManager(config({"remote": {"url": http_server.url}})) as manager:
            await started(manager)
            with pytest.raises(ToolCallError) as timed_out:
                await manager.call("remote__sleep", {"seconds": 60, "marker": str(marker)}, timeout_s=0.5)
            assert timed_out.value.kind == "timeout"
            await until(lambda: read(marker) == "cancelled", "the server's handler cancelled")
            assert (await manager.call("remote__add", {"a": 1, "b": 2})).text == "3"

    asyncio.run(scenario())


def test_a_10_mb_result_is_cut_and_an_answer_past_the_limit_is_refused(http_server: HttpToolServer) -> None:
    async def scenario() -> None:
        async with McpManager(config({"remote": {"url": http_server.url}})) as manager:
            await started(manager)
            result = await manager.call("remote__big", {"chars": 10_000_000}, max_result_chars=1000)
            assert result.truncated and result.total_chars == 10_000_000
            note = "[truncated: the result was 10,000,000 characters; the first 1,000 are above]"
            assert result.text == "0123456789" * 100 + "\n" + note
            with pytest.raises(ToolCallError, match=f"longer than {MAX_MESSAGE_BYTES:,} bytes") as refused:
                await manager.call("remote__big", {"chars": MAX_MESSAGE_BYTES + 1})
            assert refused.value.kind == "too_large"
            assert (await manager.call("remote__add", {"a": 1, "b": 2})).text == "3"

    asyncio.run(scenario())


def test_a_server_that_dies_mid_call_is_a_named_error_and_works_again_once_back(http_server: HttpToolServer) -> None:
    async def scenario() -> None:
        async with McpManager(config({"remote": {"url": http_server.url}})) as manager:
            await started(manager)
            with pytest.raises(ToolCallError) as died:
                await manager.call("remote__crash", {})
            assert died.value.kind == "server_died"
            assert http_server.wait_exit() == 3
            await until(lambda: manager.status()[0].state == "failed", "the crash seen")
            assert manager.tools() == []
            http_server.start()
            await until(lambda: manager.status()[0].state == "ready", "the server reconnected")
            assert (await manager.call("remote__add", {"a": 1, "b": 2})).text == "3"

    asyncio.run(scenario())
