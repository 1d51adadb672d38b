"""A published MCP server, mcp-server-time (PyPI), over stdio: listed and called as a user's config would run it."""

from __future__ import annotations

import asyncio
import json
import sys

from mcp_helpers import config, started

from webchat.mcp.manager import McpManager


def test_the_published_time_server_is_listed_and_called() -> None:
    entry = {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}

    async def scenario() -> None:
        async with McpManager(config({"time": entry})) as manager:
            await started(manager)
            tools = {tool.qualified_name: tool for tool in manager.tools()}
            assert set(tools) == {"time__get_current_time", "time__convert_time"}
            assert tools["time__get_current_time"].input_schema["required"] == ["timezone"]
            result = await manager.call("time__get_current_time", {"timezone": "Europe/Paris"})
            assert not result.is_error
            assert json.loads(result.text)["timezone"] == "Europe/Paris"
            converted = await manager.call("time__convert_time", {"source_timezone": "UTC", "time": "12:00",
                                                                   "target_timezone": "Asia/Tokyo"})
            assert json.loads(converted.text)["target"]["datetime"].endswith("T21:00:00+09:00")
            wrong = await manager.call("time__get_current_time", {"timezone": "Nowhere/Else"})
            assert wrong.is_error and "Nowhere/Else" in wrong.text

    asyncio.run(scenario())
