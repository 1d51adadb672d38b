"""`webchat serve`: the Starlette app (page, static files, info, websocket) over one model and one GPU worker."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.websockets import WebSocket, WebSocketDisconnect

from webchat.engine import events as ev
from webchat.grammar.matcher import GrammarConstraint
from webchat.serve import protocol as p
from webchat.serve import scoring as score
from webchat.serve import thinking
from webchat.serve.backend import Backend, Job
from webchat.serve.config import ServerConfig, content_security_policy, origin_allowed, static_version
from webchat.serve.device import DeviceThread
from webchat.serve.limits import (
    AcceptErrorLog,
    ConnectionGuard,
    HostCheck,
    TokenCheck,
    default_max_connections,
)
from webchat.serve.models import Card, Fleet, ModelError, Models, scan
from webchat.serve.openai.routes import OpenAIApi
from webchat.serve.outbox import Outbox, SendClock
from webchat.serve.replyformat import format_grammar, grammar_work, kept_ids, make_constraint, upstream_bounds
from webchat.serve.rules import RuleError, context_room, short_repr, speculative_mode
from webchat.serve.runtime import (
    RemoteRuntime,
    Runtime,
    encode_text_work,
    load_remote_runtime,
    load_runtime,
    text_chars,
    warm_up,
)
from webchat.serve.worker import Worker
from webchat.text.chat_encode import ContentRewritten
from webchat.text.trim import fit_history

if TYPE_CHECKING:
    from webchat.engine.sequence import GenerationRequest

log = logging.getLogger("webchat.serve.app")

# ---------------------------------------------------------------- one websocket
CLOSE_POLICY = 1008  # close code: the peer does not read its replies, or sends nothing but invalid frames
MAX_BAD_FRAMES = 256  # frames in a row that get an error reply before the connection is closed (a flood)
# seconds between a connection's chunk messages: tokens that come faster merge into the next one, so a page gets at
# most ~100 chunks a second however fast the model runs, and its Stop never waits behind a backlog of them
CHUNK_INTERVAL = 0.01


class Connection:
    """One browser tab: a receive task (generate, stop) beside a send loop (hello, worker messages, errors)."""

    def __init__(self, websocket: WebSocket, runtime: Runtime, worker: Backend, config: ServerConfig,
                 guard: ConnectionGuard | None = None, models: Models | None = None) -> None:  # fmt: skip
        self.ws, self.runtime, self.worker, self.config, self.guard = websocket, runtime, worker, config, guard
        self.models = models  # several local models (None: a remote engine)
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
        receiver = asyncio.create_task(self._receive_loop())
        sender = asyncio.create_task(self._send_loop())
        watchdog = asyncio.create_task(self._watch_stall())
        try:
            await asyncio.wait({receiver, sender, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # no await here: the handler returns at once, the tasks finish on their own
            self.worker.close(self.key)  # drops a queued or running request, frees the KV cache
            for task in (receiver, sender, watchdog):
                task.add_done_callback(_log_failure)
                task.cancel()

    def deliver(self, request_id: str, want_tokens: bool, trimmed: int, event: ev.Event) -> None:
        """A worker event for request `request_id`, on the event loop; `start` learns how many messages were trimmed."""
        if isinstance(event, ev.Finished | ev.Failed) and request_id == self.current:
            self.current = None
        if isinstance(event, ev.Started) and trimmed:
            event = dataclasses.replace(event, trimmed_messages=trimmed)
        for msg in p.event_messages(request_id, event, want_tokens):
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
                    self.worker.cancel(self.key, msg.id)
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
            if isinstance(msg, p.Score):
                self.worker.submit(await self._score_job(msg, rt))
                return
            ask = self._thinking(msg)
            request, n_prompt, trimmed = await self._prepare(msg, rt, ask)
        except Exception as exc:
            self.current = None
            if rt is not None and self.models is not None:
                self.models.release(rt.model_name)  # its job was never submitted: no model_busy after it
            if isinstance(exc, p.ProtocolError):
                raise
            log.warning("preparing request %r failed: %s: %s", msg.id, type(exc).__name__, exc)
            raise p.ProtocolError("internal", f"preparing the prompt failed: {type(exc).__name__}: {exc}",
                                  msg.id) from None
        deliver = functools.partial(self.deliver, msg.id, request.return_probs, trimmed)
        self.worker.submit(Job(key=self.key, request_id=msg.id, request=request, deliver=deliver,
                               prompt_tokens=n_prompt, client=self.key,
                               messages=[m.model_dump() for m in msg.messages], continue_final=msg.continue_,
                               prefix_ids=msg.prefix_ids, model=rt.model_name if self.models is not None else None,
                               thinking=ask,
                               upstream=None if msg.response_format is None or rt.tokenizer is not None else
                               {"response_format": msg.response_format.model_dump(by_alias=True, exclude_none=True)}))

    async def _score_job(self, msg: p.Score, rt: Runtime) -> Job:
        """A `score` (webchat.serve.scoring): the text read in one prefill, its tokens answered as `scored`."""
        request, n_prompt, scoring = await score.prepare(msg, rt)
        reply = score.ScoreReply(msg.id, rt.model_name, scoring)
        messages = None if msg.messages is None else [m.model_dump() for m in msg.messages]
        return Job(key=self.key, request_id=msg.id, request=request, prompt_tokens=n_prompt, client=self.key,
                   deliver=functools.partial(self._deliver_score, reply), messages=messages, scoring=scoring,
                   model=rt.model_name if self.models is not None else None)

    def _deliver_score(self, reply: score.ScoreReply, event: ev.Event) -> None:
        if isinstance(event, ev.Finished | ev.Failed) and reply.request_id == self.current:
            self.current = None
        for msg in reply.messages(event):
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

    async def _prepare(self, msg: p.Generate, rt: Runtime, ask: thinking.Ask) -> tuple[GenerationRequest, int, int]:
        """Validate what pydantic cannot (mode, vocabulary, context), template, encode and trim the history: the
        generator request, its prompt length and how many messages were left out."""
        from webchat.engine.sequence import GenerationRequest
        from webchat.engine.settings import SamplingSettings, SettingsError, token_id

        try:
            mode = speculative_mode(msg.speculative, rt.default_mode, rt.modes)
        except RuleError as exc:
            raise p.ProtocolError("bad_settings", exc.message, msg.id) from None
        bias = msg.settings.token_bias_ids()
        if rt.tokenizer is None:  # a remote engine (RemoteRuntime): the upstream templates, counts and checks ids
            try:
                settings = SamplingSettings(**msg.settings.model_dump(exclude={"token_bias"}), token_bias=bias)
            except SettingsError as exc:
                raise p.ProtocolError("bad_settings", f"settings.{exc}", msg.id) from None
            return GenerationRequest(prompt_ids=[], settings=settings, max_new_tokens=msg.max_new_tokens,
                                     stop_strings=list(msg.stop), return_probs=msg.alternatives > 0,
                                     top_alts=msg.alternatives, speculative=mode), 0, 0
        try:
            for key in msg.settings.token_bias:
                token_id(key, rt.tokenizer.vocab_size)
            settings = SamplingSettings(**msg.settings.model_dump(exclude={"token_bias"}), token_bias=bias)
        except SettingsError as exc:
            raise p.ProtocolError("bad_settings", f"settings.{exc}", msg.id) from None
        if msg.prefix_ids is not None:
            self._check_prefix(msg, rt)
        budget = max(rt.context_length - msg.max_new_tokens, 1)
        try:
            encode = functools.partial(rt.encode_chat, continue_final=msg.continue_, prefix_ids=msg.prefix_ids,
                                       template_kwargs=ask.kwargs)
            history = [m.model_dump() for m in msg.messages]
            fitted = await encode_text_work(fit_history, encode, history, budget, chars=text_chars(history))
            # its generation prompt under these template variables is rendered once (cached): a template's work too
            reasoning = await encode_text_work(thinking.thinking_for, rt.tokenizer, history, msg.continue_, ask,
                                               chars=text_chars(history))
        except (jinja2.TemplateError, ContentRewritten) as exc:
            field = "continue" if msg.continue_ and isinstance(exc, ContentRewritten) else "messages"
            raise p.ProtocolError("bad_message", f"field '{field}': the chat template failed on them: {exc}",
                                  msg.id) from None
        ids = fitted.ids
        try:  # not even one new token fits: the last message (and system) alone
            context_room(len(ids), rt.context_length)
        except RuleError as exc:
            raise p.ProtocolError("prompt_too_long", f"{exc.message} (older messages are left out to fit, the system "
                                  "prompt and the latest message are not)", msg.id) from None
        # fitted.fits False: the prompt fits but max_new_tokens does not; the reply ends at `context_full`
        request = GenerationRequest(prompt_ids=ids, settings=settings, max_new_tokens=msg.max_new_tokens,
                                    stop_strings=list(msg.stop), stop_token_ids=None,
                                    return_probs=msg.alternatives > 0, top_alts=msg.alternatives,
                                    return_logits=False, speculative=mode, thinking=reasoning,
                                    constraint=await format_constraint(msg, rt))
        return request, len(ids), fitted.dropped

    def _thinking(self, msg: p.Generate) -> thinking.Ask:
        """The request's template variables and reasoning budget, checked (`bad_message` / `bad_settings`)."""
        kwargs = dict(msg.chat_template_kwargs or {})
        try:
            thinking.check_kwargs(kwargs)
        except ValueError as exc:
            raise p.ProtocolError("bad_message", f"field 'chat_template_kwargs': {exc}", msg.id) from None
        return thinking.Ask(kwargs=kwargs, budget=thinking.budget_value(msg.reasoning_budget,
                                                                        self.config.reasoning_budget))

    def _check_prefix(self, msg: p.Generate, rt: Runtime) -> None:
        """prefix_ids inside the vocabulary and spelling the final message's content, else `bad_message`."""
        from webchat.engine.settings import SettingsError, check_token_ids
        from webchat.text.detok import decode_all

        tokenizer = rt.local()[1]
        ids = msg.prefix_ids or []
        try:
            check_token_ids(ids, tokenizer.vocab_size, "prefix_ids")
        except SettingsError as exc:
            raise p.ProtocolError("bad_message", f"field 'prefix_ids': {exc}", msg.id) from None
        text, content = decode_all(tokenizer.token_bytes, ids), msg.messages[-1].content
        if text != content:
            at = next((i for i, (a, b) in enumerate(zip(text, content, strict=False)) if a != b),
                      min(len(text), len(content)))
            raise p.ProtocolError("bad_message", f"field 'prefix_ids': the {len(ids)} ids spell {short_repr(text)}, "
                                  f"the final message is {short_repr(content)} (they differ from character {at}); "
                                  "they must be that message's tokens", msg.id)


async def format_constraint(msg: p.Generate, rt: Runtime) -> GrammarConstraint | None:
    """The reply format's constraint (docs/protocol.md, `response_format`), the kept reply of a Continue or a branch
    replayed into it; `bad_message` naming the field when the format or the kept reply cannot be."""
    if msg.response_format is None:
        return None
    if rt.tokenizer is None:  # a remote engine enforces it (Job.upstream), within our bounds
        fields = {"response_format": msg.response_format.model_dump(by_alias=True, exclude_none=True)}
        try:
            await grammar_work(upstream_bounds, fields, field="response_format")
        except RuleError as exc:
            raise p.ProtocolError("bad_message", f"field '{exc.field}': {exc.message}", msg.id) from None
        return None
    tokenizer = rt.tokenizer
    kept = msg.prefix_ids
    if kept is None and msg.continue_:
        kept = kept_ids(tokenizer, msg.messages[-1].content)
    try:
        grammar = await grammar_work(format_grammar, msg.response_format, "response_format", field="response_format")
        return await make_constraint(tokenizer, rt.local()[0].args.vocab_size, grammar, "response_format", kept)
    except RuleError as exc:
        raise p.ProtocolError("bad_message", f"field '{exc.field}': {exc.message}", msg.id) from None


def _log_failure(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, WebSocketDisconnect | OSError):
        log.error("websocket handler failed", exc_info=exc)


# ---------------------------------------------------------------- the app
def _models(config: ServerConfig, rt: Runtime, device: DeviceThread) -> Models:
    """The catalog (the loaded default, --models-dir) and its Fleet of workers on `device`."""
    loop = asyncio.get_running_loop()

    def make_worker(r: Runtime) -> Worker:
        _, tokenizer, engine = r.local()
        return Worker(engine, tokenizer.id_to_text, loop, config.max_sessions, config.max_queue, device=device,
                      stream_interval=config.stream_interval)

    try:
        cards = scan(config.model_dir, config.models_dir)
        default = next(iter(cards.values()))
        if default.name != rt.model_name:  # a .gguf's cache folder: the name the runtime serves it under
            cards = {rt.model_name: dataclasses.replace(default, name=rt.model_name), **{
                k: v for k, v in cards.items() if k != default.name}}
    except (OSError, ValueError) as exc:  # a runtime handed in without its folder (tests): described from itself
        log.info("the default model's folder is not described (%s); serving it alone", exc)
        cards = {rt.model_name: Card(rt.model_name, config.model_dir, 0, "unknown", rt.weights, rt.context_length,
                                     default=True)}
    models = Models(cards, config, Fleet(device, rt.model_name), make_worker, config.max_models,
                    config.memory_budget)
    models.attach(rt)
    return models



def create_app(config: ServerConfig, runtime: Runtime | None = None) -> Starlette:
    """The app; its lifespan loads the model (unless `runtime` is given) and starts the worker."""

    templates = Jinja2Templates(directory=str(config.templates_dir))
    version = static_version(config.static_dir)
    guard = ConnectionGuard(config.max_connections or default_max_connections(), config.handshake_timeout)
    api = OpenAIApi(config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        worker: Backend
        models: Models | None = None
        if runtime is None and config.engine_url is not None:
            remote = await load_remote_runtime(config)
            rt: Runtime = remote
            worker = remote.remote()
        else:
            device = DeviceThread()  # the one thread that loads, warms and steps the model (webchat.serve.device)
            device.start()
            try:
                rt = runtime if runtime is not None else await device.run(lambda: warm_up(load_runtime(config)))
            except BaseException:
                device.stop()
                raise
            if isinstance(rt, RemoteRuntime):
                device.stop()
                worker = rt.remote()
            else:
                models = _models(config, rt, device)
                worker = models.fleet
        worker.start()
        loop = asyncio.get_running_loop()
        previous_handler = loop.get_exception_handler()
        loop.set_exception_handler(AcceptErrorLog())
        if isinstance(rt, RemoteRuntime) and runtime is None:
            caps = rt.remote().caps
            print(f"webchat: generation on {caps.url} ({caps.kind}, {caps.state}"
                  f"{': ' + caps.error if caps.error else ''}) ready at {display_url(config)}", flush=True)
        elif runtime is None:
            print(f"webchat: {rt.model_name} on {rt.device} ({rt.dtype}, weights {rt.weights}) ready at "
                  f"{display_url(config)}", flush=True)
        try:
            yield {"runtime": rt, "worker": worker, "config": config, "models": models}
        finally:
            loop.set_exception_handler(previous_handler)
            api.close()
            worker.stop()
            if isinstance(rt, RemoteRuntime):
                await rt.remote().aclose()

    async def index(request: Request) -> Response:
        rt: Runtime = request.state.runtime
        context = {"model_name": rt.model_name, "context_length": rt.context_length, "static_version": version}
        response = templates.TemplateResponse(request, "index.html", context)
        _secure_headers(response, request.headers.get("host"))
        return response

    async def info(request: Request) -> Response:
        rt: Runtime = request.state.runtime
        body = rt.hello().model_dump(exclude={"type"})
        if request.state.models is not None:
            body["models"] = request.state.models.wire()
        snap = request.state.worker.snapshot()
        body.update(max_sessions=config.max_sessions, max_queue=config.max_queue, default_speculative=rt.default_mode,
                    active=len(snap.active), queued=len(snap.pending))
        if rt.engine is not None:
            body["kv_pool"] = rt.engine.pool_info()
            body["speculation"] = rt.engine.auto.info()  # the auto mode's cost curve and decisions
        if rt.device == "cpu":
            from webchat.kernels.cpu.build import running

            body["cpu_kernels"] = running()  # {"path": "avx2", "vnni": false}; None: float32 PyTorch ops
        return JSONResponse(body)

    async def healthz(request: Request) -> Response:
        snap = request.state.worker.snapshot()
        pool = request.state.runtime.engine.pool_info() if request.state.runtime.engine is not None else None
        return JSONResponse({"status": "ok", "active": len(snap.active), "queued": len(snap.pending),
                             "sessions": snap.sessions, "kv_pool": pool})

    async def ws_endpoint(websocket: WebSocket) -> None:
        origin, host = websocket.headers.get("origin"), websocket.headers.get("host")
        if not origin_allowed(origin, host, config):
            log.warning("refused a websocket from origin %r (host %r)", origin, host)
            await _refuse(websocket, f"origin {origin!r} is not allowed; serve the page from this server "
                                     "or pass --allow-origin")
            return
        await websocket.accept()
        conn = Connection(websocket, websocket.state.runtime, websocket.state.worker, config, guard,
                          websocket.state.models)
        await conn.serve()

    routes = [
        Route("/", index),
        Route("/api/info", info),
        Route("/healthz", healthz),
        WebSocketRoute("/ws", ws_endpoint),
        *api.routes(),
        Mount("/static", StaticFiles(directory=str(config.static_dir), check_dir=False), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.guard = guard  # `serve` hands it to uvicorn's protocols (webchat.serve.limits)
    if config.trusted_hosts is not None:
        app.add_middleware(HostCheck, allowed=config.trusted_hosts)
    if config.access_token:
        app.add_middleware(TokenCheck, token=config.access_token, skip_prefix="/v1" if config.api_key else None)
    app.state.openai = api
    return app


def _secure_headers(response: Response, host: str | None) -> None:
    response.headers["Content-Security-Policy"] = content_security_policy(host)
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Frame-Options"] = "DENY"


async def _refuse(websocket: WebSocket, message: str) -> None:
    """403 before the handshake completes (a close before accept is a 403 in uvicorn too)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(PlainTextResponse(message, status_code=403))
    else:
        await websocket.close(code=1008)


def display_url(config: ServerConfig) -> str:
    host = config.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.port}/"
