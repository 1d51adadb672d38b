"""One browser tab on `/ws` (docs/protocol.md): a receive task (generate, score, call_tool, stop) beside a send loop
(hello, tools, worker messages, tool results, errors), each request prepared on the one request path
(webchat.serve.requests) and submitted to the backend, each tool call run in a task of its own (webchat.serve.toolhub);
a connection that does not read its replies, or floods invalid frames, is closed."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from webchat.engine import events as ev
from webchat.engine.settings import SamplingSettings, token_id
from webchat.serve import protocol as p
from webchat.serve import thinking
from webchat.serve.backend import Backend, Job
from webchat.serve.config import ServerConfig
from webchat.serve.encode import OFFLOAD_TOKENS, offload
from webchat.serve.limits import ConnectionGuard
from webchat.serve.models import ModelError, Models
from webchat.serve.outbox import Outbox, SendClock
from webchat.serve.replycalls import ReplyCalls, kept_answer
from webchat.serve.replyformat import format_grammar
from webchat.serve.requests import Prepared, RequestError, Score, Turn
from webchat.serve.runtime import Runtime
from webchat.serve.scoring import ScoreReply
from webchat.serve.tools import Tools
from webchat.text.toolformat import GENERIC

if TYPE_CHECKING:
    from webchat.serve.toolhub import ToolHub  # imported only with --mcp-config (the MCP SDK)

log = logging.getLogger("webchat.serve.ws")

CLOSE_POLICY = 1008  # close code: the peer does not read its replies, or sends nothing but invalid frames
MAX_BAD_FRAMES = 256  # frames in a row that get an error reply before the connection is closed (a flood)
# seconds between a connection's chunk messages: tokens that come faster merge into the next one, so a page gets at
# most ~100 chunks a second however fast the model runs, and its Stop never waits behind a backlog of them
CHUNK_INTERVAL = 0.01


@dataclass
class RunningCall:
    """The tool call in flight on a connection: a `call_tool`'s id, its tool, its task and when it began."""

    id: str
    name: str
    task: asyncio.Task[None]
    start: float


class Connection:
    """One browser tab: a receive task (generate, stop) beside a send loop (hello, worker messages, errors)."""

    def __init__(self, websocket: WebSocket, runtime: Runtime, worker: Backend, config: ServerConfig,
                 guard: ConnectionGuard | None = None, models: Models | None = None,
                 tools: ToolHub | None = None) -> None:  # fmt: skip
        self.ws, self.runtime, self.worker, self.config, self.guard = websocket, runtime, worker, config, guard
        self.models = models  # several local models (None: a remote engine)
        self.tools = tools  # the --mcp-config servers (None: none configured)
        self.enabled: set[str] = set()  # the tools the last generate switched on: the only ones call_tool may run
        self.call: RunningCall | None = None
        self.max_bytes = config.max_message_bytes
        self.key = object()  # the worker's handle for this connection's session
        self.current: str | None = None  # the id of the request in flight
        self.outbox = Outbox(config.max_pending_bytes)
        self.clock = SendClock()
        self.bad_frames = 0  # frames in a row answered with an error

    async def serve(self) -> None:
        hello = self.runtime.hello()
        if self.models is not None:
            hello.models = self.models.wire()
        self.outbox.push(hello)
        if self.tools is not None:
            self.outbox.push(self.tools.message())  # the servers now; again on every change (_watch_tools)
        receiver = asyncio.create_task(self._receive_loop())
        sender = asyncio.create_task(self._send_loop())
        watchdog = asyncio.create_task(self._watch_stall())
        others = [asyncio.create_task(self._watch_tools())] if self.tools is not None else []
        try:
            await asyncio.wait({receiver, sender, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # no await here: the handler returns at once, the tasks finish on their own
            self.worker.close(self.key)  # drops a queued or running request, frees the KV cache
            if self.call is not None:
                others.append(self.call.task)  # a tool call in flight is abandoned; the SDK tells its server
            for task in (receiver, sender, watchdog, *others):
                task.add_done_callback(_log_failure)
                task.cancel()

    def deliver(self, request_id: str, want_tokens: bool, trimmed: int, calls: ReplyCalls | None,
                event: ev.Event) -> None:  # fmt: skip
        """A worker event for request `request_id`, on the event loop; `start` learns how many messages were trimmed,
        and a reply with tools has its calls parsed (`done.tool_calls`)."""
        if isinstance(event, ev.Finished | ev.Failed) and request_id == self.current:
            self.current = None
        if isinstance(event, ev.Started) and trimmed:
            event = dataclasses.replace(event, trimmed_messages=trimmed)
        if calls is not None:
            calls.see(event)
        for msg in p.event_messages(request_id, event, want_tokens):
            if isinstance(msg, p.Done) and calls is not None:
                msg.tool_calls = calls.finish()
            self.outbox.push(msg)

    async def _send_loop(self) -> None:
        while True:
            items = await self.outbox.take()
            for msg in items:
                self.clock.since = time.monotonic()
                await self.ws.send_text(p.dump(msg))  # waits while uvicorn's write buffer is over its high-water mark
                self.clock.since = None
                self.outbox.sent(msg)
            if any(isinstance(msg, p.Chunk) for msg in items):
                await asyncio.sleep(CHUNK_INTERVAL)  # chunks pushed meanwhile merge in the outbox

    async def _receive_loop(self) -> None:
        while True:
            await self.outbox.room()  # past max_pending_bytes: read no more frames (backpressure)
            frame = await self.ws.receive()
            if frame["type"] == "websocket.disconnect":
                return
            raw = frame.get("text")
            rid: str | None = None
            try:
                msg = p.parse_client_message(raw if raw is not None else frame.get("bytes") or b"", self.max_bytes)
                rid = msg.id
                if isinstance(msg, p.Stop):
                    self._stop(msg.id)
                elif isinstance(msg, p.CallTool):
                    self._call_tool(msg)
                else:
                    await self._generate(msg)  # a generate, or a score
                self.bad_frames = 0
                continue
            except p.ProtocolError as exc:
                self.outbox.push(exc.to_message())
            except Exception as exc:  # a bug: report it, keep the connection
                log.exception("handling a frame failed")
                self.outbox.push(p.Error(id=rid, code="internal", message=f"{type(exc).__name__}: {exc}"))
            self.bad_frames += 1
            if self.bad_frames >= MAX_BAD_FRAMES:
                await self._close(f"{self.bad_frames} invalid frames in a row")
                return

    def _stop(self, request_id: str) -> None:
        """A `stop`: the tool call of that id is cancelled (answered `cancelled` at once), else the generation."""
        call = self.call
        if call is None or call.id != request_id:
            self.worker.cancel(self.key, request_id)
            return
        assert self.tools is not None  # a call runs only with --mcp-config
        self.call = self.current = None
        call.task.cancel()  # the SDK tells the server (notifications/cancelled); the task may take seconds to end
        self.outbox.push(self.tools.cancelled(call.id, call.name, call.start))

    def _call_tool(self, msg: p.CallTool) -> None:
        """A `call_tool` checked (a listed tool this conversation enabled, a JSON object) and run in a task."""
        if self.tools is None:
            raise p.ProtocolError("bad_message", "field 'type': call_tool runs the tools of MCP servers, and this "
                                  "server was started without --mcp-config", msg.id)
        if self.current is not None:
            raise p.ProtocolError("busy_connection", f"request {self.current!r} is still running on this "
                                  "connection; send stop or wait for its end", msg.id)
        arguments = self.tools.check_call(msg, self.enabled)
        self.current = msg.id
        task = asyncio.create_task(self._run_call(self.tools, msg.id, msg.name, arguments))
        task.add_done_callback(_log_failure)
        self.call = RunningCall(msg.id, msg.name, task, time.monotonic())

    async def _run_call(self, tools: ToolHub, request_id: str, name: str, arguments: dict[str, Any]) -> None:
        try:
            result = await tools.call(request_id, name, arguments)
        except Exception as exc:  # a bug: the call still gets its one answer
            log.exception("tool call %r failed", request_id)
            result = p.ToolResult(id=request_id, name=name, text=f"webchat failed: {type(exc).__name__}: {exc}",
                                  is_error=True, error="internal")
        if self.call is not None and self.call.id == request_id:  # not stopped meanwhile
            self.call = self.current = None
            self.outbox.push(result)

    async def _watch_tools(self) -> None:
        """A `tools` message each time a server's state or tool list changes."""
        assert self.tools is not None
        while True:
            await self.tools.wait_changed()
            self.outbox.push(self.tools.message())

    async def _watch_stall(self) -> None:
        """Returns (ending the connection and releasing its session) once one write has waited stall_timeout s."""
        while not self.clock.stalled(self.config.stall_timeout):
            await asyncio.sleep(min(1.0, self.config.stall_timeout / 4))
        await self._close(f"replies unread for {self.config.stall_timeout:g} s ({self.outbox.pending} more bytes "
                          "waiting)")

    async def _close(self, reason: str) -> None:
        """Close with 1008 and `reason`, at once if the peer does not read (serve() then releases its session)."""
        log.warning("closing a websocket: %s", reason)
        try:
            await asyncio.wait_for(self.ws.close(code=CLOSE_POLICY, reason=reason[:120]), 1.0)
        except (TimeoutError, RuntimeError, OSError):
            pass
        if self.guard is not None:
            self.guard.abort_peer(self.ws.scope.get("client"))

    async def _generate(self, msg: p.Generate | p.Score) -> None:
        if self.current is not None:
            raise p.ProtocolError("busy_connection", f"request {self.current!r} is still running on this connection; "
                                  "send stop or wait for its done", msg.id)
        self.current = msg.id  # from here every error names this request and ends it
        rt: Runtime | None = None
        try:
            rt = await self._model(msg)
            job = await (self._score_job(msg, rt) if isinstance(msg, p.Score) else self._generate_job(msg, rt))
        except Exception as exc:
            self.current = None
            if rt is not None and self.models is not None:
                self.models.release(rt.model_name)  # its job was never submitted: no model_busy after it
            if isinstance(exc, p.ProtocolError):
                raise
            log.warning("preparing request %r failed: %s: %s", msg.id, type(exc).__name__, exc)
            raise p.ProtocolError("internal", f"preparing the prompt failed: {type(exc).__name__}: {exc}",
                                  msg.id) from None
        self.worker.submit(job)

    async def _generate_job(self, msg: p.Generate, rt: Runtime) -> Job:
        """The request path's Turn for a `generate` (webchat.serve.requests), prepared by the model's Preparer."""
        ask = self._thinking(msg)
        fmt = msg.response_format
        tools, cost = self._tools(msg)
        upstream: dict[str, Any] = {} if fmt is None else {
            "response_format": fmt.model_dump(by_alias=True, exclude_none=True)}
        if tools is not None:  # a remote engine sends the definitions upstream, which enforces them
            upstream["tools"] = [t.model_dump(exclude_none=True) for t in tools.tools or []]
            if msg.tool_choice is not None:
                upstream["tool_choice"] = msg.tool_choice if isinstance(msg.tool_choice, str) else (
                    msg.tool_choice.model_dump())
        turn = Turn(messages=[m.for_template() for m in msg.messages], settings=functools.partial(_settings, msg),
                    max_new_tokens=msg.max_new_tokens, fit=True, stop=list(msg.stop), top_alts=msg.alternatives,
                    want_probs=msg.alternatives > 0, speculative=msg.speculative, continue_final=msg.continue_,
                    prefix_ids=msg.prefix_ids, thinking=ask, image_max_tiles=msg.image_max_tiles,
                    reply_format=None if fmt is None else functools.partial(format_grammar, fmt, "response_format"),
                    tools=tools, upstream=upstream or None)
        prepared = await self._prepared(rt.prep.chat(turn), msg.id, cost)
        calls = None
        if prepared.plan is not None or prepared.tools_format:  # the reply may call: its calls are parsed
            kept = kept_answer(msg.messages[-1].text, prepared.request.thinking) if msg.continue_ else ""
            calls = ReplyCalls(prepared.plan.fmt if prepared.plan is not None else GENERIC, kept)
        deliver = functools.partial(self.deliver, msg.id, prepared.request.return_probs, prepared.trimmed, calls)
        return prepared.job(self.key, msg.id, deliver, self.key, rt.model_name if self.models is not None else None)

    async def _score_job(self, msg: p.Score, rt: Runtime) -> Job:
        """A `score` (webchat.serve.scoring): the text read in one prefill, its tokens answered as `scored`."""
        score = Score(msg.alternatives, None if msg.messages is None else [m.for_template() for m in msg.messages],
                      msg.text)
        prepared = await self._prepared(rt.prep.score(score), msg.id)
        assert prepared.scoring is not None  # a Score's preparation says what it scores
        reply = ScoreReply(msg.id, rt.model_name, prepared.scoring)
        return prepared.job(self.key, msg.id, functools.partial(self._deliver_score, reply), self.key,
                            rt.model_name if self.models is not None else None)

    def _tools(self, msg: p.Generate) -> tuple[Tools | None, int]:
        """The MCP tools a generate switches on (by their listed names), and what they cost of the context."""
        self.enabled = set()
        if msg.tools is None:
            if msg.tool_choice is not None:
                raise p.ProtocolError("bad_message", "field 'tool_choice': it needs 'tools' (the tools it chooses "
                                      "among), got no tools", msg.id)
            return None, 0
        if self.tools is None:
            raise p.ProtocolError("bad_message", "field 'tools': this server runs no MCP servers (start it with "
                                  "--mcp-config FILE)", msg.id)
        functions, cost = self.tools.enabled(msg.tools, msg.id)
        self.enabled = set(msg.tools)
        return Tools(functions, msg.tool_choice), cost

    @staticmethod
    async def _prepared(preparing: Awaitable[Prepared], request_id: str, tool_tokens: int = 0) -> Prepared:
        """A RequestError (webchat.serve.requests) as the protocol's error naming the field; a prompt too long with
        tools says what the tools cost of the context."""
        try:
            return await preparing
        except RequestError as exc:
            tools_note = (f"; the tools switched on take about {tool_tokens} tokens of the context: switch some off"
                          if tool_tokens else "")
            code, message = {
                "settings": ("bad_settings", exc.message),
                "too_long": ("prompt_too_long", exc.message + tools_note),
                "unsupported": ("scoring_unavailable", exc.message),
                "prefix": ("bad_message", exc.message),
                "image": ("bad_image", f"field '{exc.field}': {exc.message}"),
                "messages": ("bad_message", f"field '{exc.field}': the chat template failed on them: {exc.message}"),
            }.get(exc.kind, ("bad_message", f"field '{exc.field}': {exc.message}"))
            raise p.ProtocolError(code, message, request_id) from None

    def _deliver_score(self, reply: ScoreReply, event: ev.Event) -> None:
        if isinstance(event, ev.Finished | ev.Failed) and reply.request_id == self.current:
            self.current = None
        if isinstance(event, ev.Finished) and len(reply.tokens or []) > OFFLOAD_TOKENS:  # thousands of scored tokens
            task = asyncio.get_running_loop().create_task(self._push_formatted(reply, event))
            task.add_done_callback(_log_failure)
            return
        for msg in reply.messages(event):
            self.outbox.push(msg)

    async def _push_formatted(self, reply: ScoreReply, event: ev.Event) -> None:
        for msg in await offload(reply.messages, event, heavy=True):
            self.outbox.push(msg)

    async def _model(self, msg: p.Generate | p.Score) -> Runtime:
        """The runtime of the model the request names, loaded first if need be (`loading` messages meanwhile)."""
        if self.models is None:
            if msg.model is not None and msg.model != self.runtime.model_name:
                raise p.ProtocolError("unknown_model", f"model {msg.model!r} is not served here; the model is "
                                      f"{self.runtime.model_name!r}", msg.id)
            return self.runtime
        try:
            peer = self.ws.scope.get("client")
            return await self.models.use(msg.model, lambda info: self.outbox.push(p.Loading(id=msg.id, **info)),
                                         client=("peer", peer[0] if peer else ""))
        except ModelError as exc:
            raise p.ProtocolError(exc.code, exc.message, msg.id) from None

    def _thinking(self, msg: p.Generate) -> thinking.Ask:
        """The request's template variables and reasoning budget, checked (`bad_message` / `bad_settings`)."""
        kwargs = dict(msg.chat_template_kwargs or {})
        try:
            thinking.check_kwargs(kwargs)
        except ValueError as exc:
            raise p.ProtocolError("bad_message", f"field 'chat_template_kwargs': {exc}", msg.id) from None
        return thinking.Ask(kwargs=kwargs, budget=thinking.budget_value(msg.reasoning_budget,
                                                                        self.config.reasoning_budget))


def _settings(msg: p.Generate, vocab_size: int) -> SamplingSettings:
    """A generate's settings, its token_bias ids inside the vocabulary (SettingsError naming the field)."""
    for key in msg.settings.token_bias:
        token_id(key, vocab_size)
    return SamplingSettings(**msg.settings.model_dump(exclude={"token_bias"}), token_bias=msg.settings.token_bias_ids())


def _log_failure(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, WebSocketDisconnect | OSError):
        log.error("websocket handler failed", exc_info=exc)
