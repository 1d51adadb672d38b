"""A stdio MCP server as a child process: a safe environment, bounded reads, its stderr kept, its whole tree stopped.

webchat's own transport, not the SDK's `stdio_client`, because that one reads a line by joining and splitting the
whole buffer again on every 64 KiB read, on the event loop: a 10 MB line took 0.84 s there (0.15 s here), a 20 MB one
5.9 s, and a line is buffered without limit. Here a line is found in each new chunk only, is at most MAX_MESSAGE_BYTES
(past that the connection is closed and restarted: the request's id is not known before the line is parsed), and a
line over PARSE_OFF_LOOP_BYTES is parsed on a worker thread. The rest follows the SDK: the server starts in a new
session (its own process group), with only the SDK's safe inherited variables (HOME, LOGNAME, PATH, SHELL, TERM, USER)
and the config's `env` over them; stopping closes its stdin, waits, then SIGTERMs and SIGKILLs its process group (the
SDK's `terminate_posix_process_tree`, the MCP spec's order), every wait bounded. POSIX only.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
from anyio.abc import ByteReceiveStream, ByteSendStream, Process
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.client.stdio import get_default_environment
from mcp.os.posix.utilities import terminate_posix_process_tree
from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCMessage, jsonrpc_message_adapter

from webchat.mcp.config import StdioServer
from webchat.mcp.transport import MAX_MESSAGE_BYTES, TOO_LARGE, Link

if TYPE_CHECKING:
    from mcp.client._transport import TransportStreams

log = logging.getLogger("webchat.mcp")

PARSE_OFF_LOOP_BYTES = 1 << 20
GRACE_S = 2.0  # after its stdin closes, for the server to exit by itself (the SDK's wait)
TERM_S = 2.0  # after SIGTERM to its process group, before SIGKILL
REAP_S = 2.0  # after SIGKILL, for the exit to be seen
STDERR_TAIL_CHARS = 600
MAX_LOG_LINE = 1000


def stdio_environment(server: StdioServer) -> dict[str, str]:
    """The environment a stdio server gets: the SDK's safe inherited variables, then the config's `env`."""
    return get_default_environment() | dict(server.env)


@asynccontextmanager
async def stdio_transport(server: StdioServer, link: Link) -> AsyncIterator[TransportStreams]:
    """Start `server` and yield its message streams; on exit stop it and its process group, and fill in `link`."""
    process = await anyio.open_process([server.command, *server.args], env=stdio_environment(server),
                                       cwd=server.cwd, start_new_session=True)
    # No await from here into the task group: a cancellation landing between would leave the process running.
    assert process.stdin and process.stdout and process.stderr, "open_process gives pipes by default"
    to_session, from_server = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    to_server, from_session = anyio.create_memory_object_stream[SessionMessage](0)
    tail = StderrTail(server.name)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_messages, server.name, process.stdout, to_session, link)
            tg.start_soon(write_messages, process.stdin, from_session, link)
            tg.start_soon(tail.read, process.stderr)
            try:
                yield from_server, to_server
            finally:
                with anyio.CancelScope(shield=True):
                    await stop_process(server.name, process)
                    for stream in (from_server, to_server, to_session, from_session):
                        stream.close()
                tg.cancel_scope.cancel()
    finally:
        link.returncode = process.returncode
        link.stderr = tail.text()


async def read_messages(name: str, stdout: ByteReceiveStream,
                        sink: MemoryObjectSendStream[SessionMessage | Exception], link: Link) -> None:
    """Each line of the server's stdout as a message, until it ends or a line is past MAX_MESSAGE_BYTES."""
    buffer = bytearray()
    try:
        async with sink:
            async for chunk in stdout:
                start = 0
                while (end := chunk.find(b"\n", start)) >= 0:
                    buffer += chunk[start:end]
                    start = end + 1
                    if len(buffer) > MAX_MESSAGE_BYTES:
                        break
                    line = bytes(buffer)
                    buffer.clear()
                    message = await parse(name, line)
                    if message is not None:
                        await sink.send(SessionMessage(message))
                else:
                    buffer += chunk[start:]
                if len(buffer) > MAX_MESSAGE_BYTES:
                    link.close(f"sent a message {TOO_LARGE}", too_large=True)
                    return
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass  # our own shutdown closed the pipe, or the session is gone
    link.close("closed its standard output")


async def parse(name: str, line: bytes) -> JSONRPCMessage | None:
    """One line as a JSON-RPC message; None for a blank line or one that is not a message (logged)."""
    if not line.strip():
        return None
    try:
        if len(line) > PARSE_OFF_LOOP_BYTES:
            return await anyio.to_thread.run_sync(validate, line)
        return validate(line)
    except ValueError as exc:  # pydantic's ValidationError is one
        log.warning("%s: a line of its output is not a JSON-RPC message (%s): %.200r", name, type(exc).__name__, line)
        return None


def validate(line: bytes) -> JSONRPCMessage:
    """The SDK's own parse of a wire message."""
    return jsonrpc_message_adapter.validate_json(line, by_name=False)


async def write_messages(stdin: ByteSendStream, source: MemoryObjectReceiveStream[SessionMessage], link: Link) -> None:
    """Each message from the session as one line on the server's stdin."""
    try:
        async with source:
            async for message in source:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                await stdin.send(data.encode() + b"\n")
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        link.close("stopped reading its standard input")


async def stop_process(name: str, process: Process) -> None:
    """Close its stdin and wait; then SIGTERM its process group (what it left running too), wait, SIGKILL."""
    assert process.stdin and process.stdout and process.stderr
    with suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        await process.stdin.aclose()
    await wait_exit(process, GRACE_S)
    await terminate_posix_process_tree(process, TERM_S)
    if not await wait_exit(process, REAP_S):
        log.warning("%s: process %d still runs after SIGKILL; left behind", name, process.pid)
        return
    with anyio.move_on_after(REAP_S):
        await process.aclose()


async def wait_exit(process: Process, seconds: float) -> bool:
    """Whether the process has exited within `seconds` (its returncode polled: `wait()` also waits for its pipes)."""
    with anyio.move_on_after(seconds):
        while process.returncode is None:
            await anyio.sleep(0.01)
    return process.returncode is not None


class StderrTail:
    """A server's stderr: each line logged (cut to MAX_LOG_LINE characters), the last STDERR_TAIL_CHARS kept."""

    def __init__(self, server: str) -> None:
        self.server = server
        self._tail = ""
        self._partial = b""

    async def read(self, stderr: ByteReceiveStream) -> None:
        with suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            async for chunk in stderr:
                self.feed(chunk)

    def feed(self, chunk: bytes) -> None:
        """Take a chunk of output: whole lines are logged and kept, a partial line waits (its last bytes only)."""
        *lines, partial = (self._partial + chunk).split(b"\n")
        self._partial = partial[-MAX_LOG_LINE * 4:]
        for raw in lines:
            self._keep(raw)

    def text(self) -> str:
        """The last lines of output (and any unfinished one), at most STDERR_TAIL_CHARS characters."""
        if self._partial:
            self._keep(self._partial)
            self._partial = b""
        return self._tail.strip()

    def _keep(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip()
        if text:
            log.info("%s: %s", self.server, text[:MAX_LOG_LINE])
            self._tail = (self._tail + "\n" + text[-STDERR_TAIL_CHARS:])[-STDERR_TAIL_CHARS:]
