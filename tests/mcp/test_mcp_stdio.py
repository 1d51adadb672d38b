"""The MCP client on real stdio servers (tests/mcp/toolserver.py as the manager's child): listing, calls, the limits,
a crash and a restart, cancelling, and stop() leaving no process behind."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp_helpers import config, gone, read, started, stdio_entry, until
from toolserver import HTML

from webchat.mcp.manager import McpManager
from webchat.mcp.result import DEFAULT_MAX_RESULT_CHARS, ToolCallError
from webchat.mcp.transport import MAX_MESSAGE_BYTES

TOOLS = {"add", "echo_env", "header", "sleep", "pid", "spawn_child", "crash", "big", "html", "fail", "mixed"}


def test_tools_are_listed_with_their_schemas() -> None:
    async def scenario() -> None:
        async with McpManager(config({"tools": stdio_entry()})) as manager:
            await started(manager)
            [status] = manager.status()
            assert (status.name, status.transport, status.state, status.tool_count) == ("tools", "stdio", "ready", 11)
            tools = {tool.name: tool for tool in manager.tools()}
            assert set(tools) == TOOLS
            add = tools["add"]
            assert (add.server, add.qualified_name, add.description) == ("tools", "tools__add", "Add two integers.")
            assert add.input_schema["type"] == "object"
            assert add.input_schema["required"] == ["a", "b"]
            assert add.input_schema["properties"]["a"]["type"] == "integer"
            assert add.as_function() == {"type": "function", "function": {
                "name": "tools__add", "description": "Add two integers.", "parameters": add.input_schema}}

    asyncio.run(scenario())


def test_a_call_returns_text_and_the_server_gets_only_the_safe_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEBCHAT_TEST_SECRET", "do-not-leak")

    async def scenario() -> None:
        async with McpManager(config({"tools": stdio_entry(env={"GREETING": "hello"})})) as manager:
            await started(manager)
            result = await manager.call("tools__add", {"a": 2, "b": 40})
            assert (result.text, result.is_error, result.truncated) == ("42", False, False)
            assert (await manager.call("tools__echo_env", {"name": "GREETING"})).text == "hello"
            assert (await manager.call("tools__echo_env", {"name": "WEBCHAT_TEST_SECRET"})).text == "<unset>"
            assert (await manager.call("tools__echo_env", {"name": "PATH"})).text != "<unset>"

    asyncio.run(scenario())


def test_html_comes_back_as_the_same_characters_flagged_as_text() -> None:
    async def scenario() -> None:
        async with McpManager(config({"tools": stdio_entry()})) as manager:
            await started(manager)
            result = await manager.call("tools__html", {})
            assert result.text == HTML  # `<script>` and `&` unchanged: escaping is the page's, through textContent
            assert result.media_type == "text/plain"

    asyncio.run(scenario())


def test_other_content_is_described_and_a_tool_error_is_a_result() -> None:
    async def scenario() -> None:
        async with McpManager(config({"tools": stdio_entry()})) as manager:
            await started(manager)
            mixed = await manager.call("tools__mixed", {})
            assert mixed.text.split("\n") == ["a picture:", "[image: image/png, 100 bytes]",
                                              "[resource file:///notes.txt: text/plain, 50 characters]"]
            failed = await manager.call("tools__fail", {})
            assert failed.is_error and "this tool always fails" in failed.text
            rejected = await manager.call("tools__add", {"a": "x", "b": 1})  # the server validates: its own error
            assert rejected.is_error

    asyncio.run(scenario())


def test_unknown_tools_and_bad_arguments_are_named_errors() -> None:
    async def scenario() -> None:
        async with McpManager(config({"tools": stdio_entry()})) as manager:
            await started(manager)
            with pytest.raises(ToolCallError, match="no tool named 'tools__nope'") as unknown:
                await manager.call("tools__nope", {})
            assert unknown.value.kind == "unknown_tool"
            with pytest.raises(ToolCallError) as other_server:
                await manager.call("elsewhere__add", {"a": 1, "b": 2})
            assert other_server.value.kind == "unknown_tool"
            for bad in ([1, 2], {"a": float("nan")}, {"a": "\ud800"}):
                with pytest.raises(ToolCallError) as refused:
                    await manager.call("tools__add", bad)  # type: ignore[arg-type]
                assert refused.value.kind == "bad_arguments"
            assert (await manager.call("tools__add", {"a": 1, "b": 1})).text == "2"

    asyncio.run(scenario())


def test_a_call_past_its_time_limit_is_a_timeout_the_server_is_told_and_the_next_call_works(marker: Path) -> None:
    async def scenario() -> None:
        async with McpManager(config({"tools": stdio_entry()})) as manager:
            await started(manager)
            with pytest.raises(ToolCallError, match=r"within 0\.5 s") as timed_out:
                await manager.call("tools__sleep", {"seconds": 60, "marker": str(marker)}, timeout_s=0.5)
            assert timed_out.value.kind == "timeout"
            await until(lambda: read(marker) == "cancelled", "the server's handler cancelled")
            assert (await manager.call("tools__add", {"a": 1, "b": 2})).text == "3"

    asyncio.run(scenario())


def test_cancelling_the_caller_abandons_the_call_and_tells_the_server(marker: Path) -> None:
    async def scenario() -> None:
        async with McpManager(config({"tools": stdio_entry()})) as manager:
            await started(manager)
            outcome: list[str] = []

            async def caller() -> None:
                try:
                    await manager.call("tools__sleep", {"seconds": 60, "marker": str(marker)})
                except anyio.get_cancelled_exc_class():
                    outcome.append("cancelled")
                    raise

            async with anyio.create_task_group() as tg:
                tg.start_soon(caller)
                await until(lambda: read(marker) == "started", "the tool started")
                tg.cancel_scope.cancel()
            assert outcome == ["cancelled"]
            await until(lambda: read(marker) == "cancelled", "the server's handler cancelled")
            assert (await manager.call("tools__add", {"a": 1, "b": 2})).text == "3"

    asyncio.run(scenario())


def test_a_server_that_dies_mid_call_is_a_named_error_and_is_restarted(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"

    async def scenario() -> None:
        async with McpManager(config({"tools": stdio_entry()})) as manager:
            await started(manager)
            seen: list[str] = []

            async def watch() -> None:
                while True:
                    await manager.wait_changed()
                    seen.append(manager.status()[0].state)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                with pytest.raises(ToolCallError, match="closed the connection during 'crash'") as died:
                    await manager.call("tools__crash", {"marker": str(pid_file)})
                assert died.value.kind == "server_died"
                # the next call waits (within its time limit) for the restarted server
                assert (await manager.call("tools__add", {"a": 1, "b": 2}, timeout_s=30)).text == "3"
                tg.cancel_scope.cancel()
            assert seen[0] == "failed" and seen[-1] == "ready"  # the page is told of both
            assert (await manager.call("tools__pid", {})).text != read(pid_file)

    asyncio.run(scenario())


def test_a_10_mb_result_is_cut_with_a_note_and_a_message_past_the_limit_is_refused() -> None:
    async def scenario() -> None:
        async with McpManager(config({"tools": stdio_entry()})) as manager:
            await started(manager)
            result = await manager.call("tools__big", {"chars": 10_000_000})
            assert result.truncated and result.total_chars == 10_000_000
            kept, note = result.text.rsplit("\n", 1)
            assert kept == ("0123456789" * 1600)[:DEFAULT_MAX_RESULT_CHARS]
            assert note == "[truncated: the result was 10,000,000 characters; the first 16,000 are above]"
            with pytest.raises(ToolCallError, match=f"longer than {MAX_MESSAGE_BYTES:,} bytes") as refused:
                await manager.call("tools__big", {"chars": MAX_MESSAGE_BYTES + 1})
            assert refused.value.kind == "too_large"
            assert (await manager.call("tools__add", {"a": 1, "b": 2}, timeout_s=30)).text == "3"

    asyncio.run(scenario())


def test_stop_leaves_no_process_behind() -> None:
    async def scenario() -> list[int]:
        async with McpManager(config({"a": stdio_entry(), "b": stdio_entry()})) as manager:
            await started(manager)
            pids = [int((await manager.call(f"{s}__pid", {})).text) for s in ("a", "b")]
            pids.append(int((await manager.call("a__spawn_child", {})).text))  # left running by the server
            assert not any(gone(pid) for pid in pids)
        assert [s.state for s in manager.status()] == ["stopped", "stopped"]
        return pids

    pids = asyncio.run(scenario())
    assert [pid for pid in pids if not gone(pid)] == []


def test_servers_that_cannot_start_are_reported_by_name_and_the_others_work() -> None:
    python = sys.executable
    servers: dict[str, dict[str, Any]] = {
        "missing": {"command": "webchat-no-such-program"},
        "fails": {"command": python, "args": ["-c", "import sys; sys.exit('no API key given')"]},
        "silent": {"command": python, "args": ["-c", "import sys; sys.stdin.read()"], "connectTimeout": 1},
        "off": {**stdio_entry(), "disabled": True},
        "tools": stdio_entry(),
    }

    async def scenario() -> None:
        async with McpManager(config(servers)) as manager:
            await started(manager)
            missing, failed, silent, off, ready = manager.status()
            assert missing.state == "failed" and "'webchat-no-such-program': no such program" in missing.message
            assert failed.state == "failed" and "exited with status 1" in failed.message
            assert "no API key given" in failed.message
            assert silent.state == "failed" and "did not start and answer within 1 s" in silent.message
            assert (off.state, ready.state) == ("disabled", "ready")
            assert [t.server for t in manager.tools()] == ["tools"] * 11
            with pytest.raises(ToolCallError):
                await manager.call("missing__x", {})
            assert (await manager.call("tools__add", {"a": 1, "b": 2})).text == "3"

    asyncio.run(scenario())
