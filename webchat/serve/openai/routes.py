"""The OpenAI-compatible HTTP API (docs/api.md) on the worker the websocket uses: one queue, fair to both.

    request → guard (Origin, API key, JSON body, size) → validate → encode → Job on the shared worker
            → first event: Failed busy → 429 | else 200: JSON when the request ends, or SSE chunks as it goes
A disconnect listener races the handler (as vLLM does): a client that leaves closes its job within one step.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from webchat.engine import events as ev
from webchat.serve.config import ServerConfig, origin_allowed
from webchat.serve.encode import OFFLOAD_TOKENS, offload
from webchat.serve.models import ModelError, Models
from webchat.serve.openai.format import Reply
from webchat.serve.openai.schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    TokenizeRequest,
    parse,
    template_kwargs,
)
from webchat.serve.openai.stream import FAILED_STATUS, GONE, EventStream, Pending
from webchat.serve.openai.structured import request_grammar
from webchat.serve.requests import Prepared, RequestError, Text, Turn
from webchat.serve.runtime import Runtime
from webchat.serve.tools import ToolCalls, Tools, upstream_fields
from webchat.text.toolformat import GENERIC

log = logging.getLogger("webchat.openai")

MODEL_ERRORS = {"unknown_model": (404, "model_not_found"), "model_too_large": (400, "model_too_large"),
                "model_busy": (429, "model_busy"), "model_failed": (500, "model_failed"),
                "load_limit": (429, "load_limit")}
PATHS = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST", "/tokenize": "POST"}
ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class OpenAIApi:
    """The /v1 routes over the app's runtime and worker (read from the lifespan state on each request)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._origin_allowed = origin_allowed
        self.created = int(time.time())
        self.closing = False
        self.live: set[Pending] = set()

    def routes(self) -> list[BaseRoute]:
        both = ["POST", "OPTIONS"]
        return [
            Route("/v1/models", self._endpoint(self.models), methods=["GET", "OPTIONS"]),
            Route("/v1/models/{model:path}", self._endpoint(self.model), methods=["GET", "OPTIONS"]),
            Route("/v1/chat/completions", self._endpoint(self.chat), methods=both),
            Route("/v1/completions", self._endpoint(self.completions), methods=both),
            Route("/tokenize", self._endpoint(self.tokenize), methods=both),
            Route("/tokenize", self._endpoint(self.unknown), methods=ALL_METHODS),  # 405 in the API's shape
            Route("/v1/{rest:path}", self._endpoint(self.unknown), methods=ALL_METHODS),  # 404, or 405 on a known path
        ]

    def close(self) -> None:
        """The server is shutting down: new requests get 503 and waiting ones end with that error."""
        self.closing = True
        for pending in list(self.live):
            pending.deliver(ev.Failed("shutting_down", "the server is shutting down"))

    # ------------------------------------------------------------ handlers
    def _endpoint(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                self._guard(request)
                if request.method == "OPTIONS":
                    return self._preflight(request)
                return await handler(request)
            except APIError as exc:
                return self._error(request, exc)
            except Exception as exc:  # a bug: still the API's error shape, never a plain-text 500
                log.exception("%s %s failed", request.method, request.url.path)
                return self._error(request, APIError(500, f"internal error: {type(exc).__name__}", "internal_error"))
            finally:  # a request that ended before its job was submitted gives its model back (no model_busy after)
                claimed = getattr(request.state, "claimed", None)
                if claimed is not None:
                    request.state.models.release(claimed)

        return endpoint

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": self._model_cards(request)}, headers=self._cors(request))

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        card = next((c for c in self._model_cards(request) if c["id"] == name), None)
        if card is None:
            self._check_model(request, name, None)
        return JSONResponse(card, headers=self._cors(request))

    async def unknown(self, request: Request) -> Response:
        if request.url.path in PATHS:
            raise APIError(405, f"{request.url.path} takes {PATHS[request.url.path]}, got {request.method}",
                           "method_not_allowed")
        raise APIError(404, f"no route {request.method} {request.url.path}; the API serves {sorted(PATHS)}",
                       "unknown_url")

    async def chat(self, request: Request) -> Response:
        req: ChatRequest = parse(ChatRequest, await self._body(request))
        req.check()
        ask = req.thinking(self.config.reasoning_budget)
        rt = await self._runtime(request, req.model)
        turn = Turn(messages=[m.for_template() for m in req.messages], settings=req.sampling,
                    max_new_tokens=req.limit(), fit=False, stop=req.stops(),
                    top_alts=(req.top_logprobs or 0) if req.logprobs else 0, want_probs=bool(req.logprobs),
                    speculative=req.speculative, continue_final=bool(req.continue_final_message),
                    add_generation_prompt=req.add_generation_prompt is not False, thinking=ask,
                    reply_format=functools.partial(request_grammar, req.response_format, req.structured_outputs),
                    format_field=_format_field(req),
                    tools=Tools(req.tools, req.tool_choice, req.parallel_tool_calls),
                    prompt_logprobs=req.scored(), upstream=upstream_fields(req), image_max_tiles=req.image_max_tiles)
        with _request_errors("messages"):
            prepared = await rt.prep.chat(turn)
        plan = prepared.plan
        tools = plan.fmt if plan is not None else GENERIC if prepared.tools_format else None
        reply = Reply(chat=True, model=rt.model_name, tokenizer=rt.tokenizer,
                      logprobs=(req.top_logprobs or 0) if req.logprobs else None, token_ids=bool(req.return_token_ids),
                      include_usage=bool(req.stream_options and req.stream_options.include_usage),
                      prompt_logprobs=req.prompt_logprobs,
                      tools=ToolCalls(tools, plan is not None and plan.required) if tools is not None else None,
                      raw=not ask.split)
        return await self._run(request, prepared, reply, bool(req.stream), self._job_model(request, rt))

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await self._body(request))
        req.check()
        rt = await self._runtime(request, req.model)
        text = Text(prompt=req.one_prompt(), settings=req.sampling, max_new_tokens=req.max_tokens, stop=req.stops(),
                    top_alts=req.logprobs or 0, want_probs=req.logprobs is not None, speculative=req.speculative,
                    reply_format=functools.partial(request_grammar, req.response_format, req.structured_outputs),
                    format_field=_format_field(req), prompt_logprobs=req.scored())
        with _request_errors("prompt"):
            prepared = await rt.prep.text(text)
        reply = Reply(chat=False, model=rt.model_name, tokenizer=rt.tokenizer, logprobs=req.logprobs,
                      token_ids=bool(req.return_token_ids),
                      include_usage=bool(req.stream_options and req.stream_options.include_usage),
                      echo=prepared.echo if req.echo else None, prompt_logprobs=req.prompt_logprobs)
        return await self._run(request, prepared, reply, bool(req.stream), self._job_model(request, rt))

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: the prompt ids a chat (as /v1/chat/completions templates it) or a text would run on; a
        remote engine's front uses it to send a branch's token ids after the chat's own prompt."""
        req: TokenizeRequest = parse(TokenizeRequest, await self._body(request))
        req.check()
        rt = await self._runtime(request, req.model)
        messages = None if req.messages is None else [m.for_template() for m in req.messages]
        cont = bool(req.continue_final_message)
        add = not cont if req.add_generation_prompt is None else req.add_generation_prompt
        with _request_errors("messages"):
            ids = await rt.prep.tokens(messages, req.prompt, add, cont, template_kwargs(req.chat_template_kwargs))
        return JSONResponse({"count": len(ids), "max_model_len": rt.context_length, "tokens": ids},
                            headers=self._cors(request))

    def _client(self, request: Request) -> Hashable:
        """Who is asking, for fair admission (webchat.serve.worker): the API key where the server has one, else the
        peer's address (every connection from one host is one client)."""
        if self.config.api_key:
            return ("key", request.headers.get("authorization", ""))
        return ("peer", request.client.host if request.client is not None else "")

    async def _run(self, request: Request, prepared: Prepared, reply: Reply, stream: bool,
                   model: str | None = None) -> Response:
        """Submit the job and answer: errors before the first event keep their status; streams begin at 200."""
        if self.closing:
            raise APIError(503, "the server is shutting down", "shutting_down")
        pending = Pending(request.state.worker)
        self.live.add(pending)
        pending.worker.submit(prepared.job(pending.key, reply.id, pending.deliver, self._client(request), model))
        request.state.claimed = None  # the submission released it
        watcher = asyncio.create_task(pending.watch(request.receive))
        streaming = False
        try:
            events = await pending.next()
            _raise_failure(events[0])
            if stream:
                streaming = True  # the stream's body ends the job
                return EventStream(pending, watcher, reply, events, self._cors(request), self.live.discard)
            while True:
                for event in events:
                    if event is GONE:
                        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
                    _raise_failure(event)
                    if isinstance(event, ev.Tokens):
                        reply.add(event)
                    elif isinstance(event, ev.PromptTokens):  # thousands of scored tokens: formatted off the loop
                        await offload(reply.prompt, event, heavy=len(event.tokens) > OFFLOAD_TOKENS)
                    elif isinstance(event, ev.Finished):
                        heavy = reply.scored is not None or len(reply.entries) > OFFLOAD_TOKENS
                        body = await offload(_json_body, reply.response(event), heavy=heavy)
                        return Response(body, media_type="application/json", headers=self._cors(request))
                events = await pending.next()
        finally:
            if not streaming:
                pending.end(watcher)
                self.live.discard(pending)

    # ------------------------------------------------------------ checks
    def _guard(self, request: Request) -> None:
        """Origin first (a foreign page must not reach the model), then the API key when one is set."""
        origin, host = request.headers.get("origin"), request.headers.get("host")
        if not self._origin_allowed(origin, host, self.config):
            log.warning("refused an API request from origin %r (host %r)", origin, host)
            raise APIError(403, f"origin {origin!r} is not allowed; call the API from a non-browser client, this "
                           "server's own page, or an origin passed with --allow-origin", "origin_not_allowed")
        key = self.config.api_key
        if key is not None and request.method != "OPTIONS":
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                got = "no Authorization header" if "authorization" not in request.headers else "a different key"
                raise APIError(401, f"expected 'Authorization: Bearer <the --api-key>', got {got}", "invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        """The JSON body, refused unless sent as application/json (a form or text/plain from a page is not)."""
        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"the body must be sent as Content-Type: application/json, got {ctype or 'none'!r}",
                           "unsupported_media_type")
        limit = self.config.max_message_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the body is {declared} bytes; the limit is {limit} bytes", "request_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise APIError(413, f"the body is over {limit} bytes, the limit", "request_too_large")
        return bytes(body)

    async def _runtime(self, request: Request, name: str | None) -> Runtime:
        """The runtime of the model a request names (loaded first where need be; None: the default)."""
        models: Models | None = request.state.models
        if models is None:
            if name is not None:
                self._check_model(request, name, "model")
            return request.state.runtime  # type: ignore[no-any-return]
        try:
            rt = await models.use(name, client=self._client(request))
            request.state.claimed = rt.model_name  # released by the job's submission, or by _endpoint on an error
            return rt
        except ModelError as exc:
            status, code = MODEL_ERRORS[exc.code]
            raise APIError(status, exc.message, code, "model") from None

    @staticmethod
    def _job_model(request: Request, rt: Runtime) -> str | None:
        return rt.model_name if request.state.models is not None else None

    def _model_cards(self, request: Request) -> list[dict[str, Any]]:
        models: Models | None = request.state.models
        if models is None:
            return [self._model_card(request)]
        return [{"id": c["name"], "object": "model", "created": self.created, "owned_by": "webchat",
                 **{k: v for k, v in c.items() if k != "name"}} for c in models.wire()]

    def _check_model(self, request: Request, name: str, param: str | None) -> None:
        models: Models | None = request.state.models
        served = list(models.cards) if models is not None else [request.state.runtime.model_name]
        if name not in served:
            raise APIError(404, f"model {name!r} does not exist; this server serves {served} (GET /v1/models)",
                           "model_not_found", param)

    def _model_card(self, request: Request) -> dict[str, Any]:
        rt = request.state.runtime
        return {"id": rt.model_name, "object": "model", "created": self.created, "owned_by": "webchat",
                "context_length": rt.context_length}

    def _cors(self, request: Request) -> dict[str, str]:
        """CORS for origins passed with --allow-origin (same-origin pages need none; others are refused above)."""
        origin = request.headers.get("origin")
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if origin in self.config.allow_origins else {}

    def _preflight(self, request: Request) -> Response:
        headers = {**self._cors(request), "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                   "Access-Control-Allow-Headers": "Authorization, Content-Type", "Access-Control-Max-Age": "600"}
        return Response(status_code=204, headers=headers)

    def _error(self, request: Request, exc: APIError) -> Response:
        headers = self._cors(request)
        if exc.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if exc.status in (429, 503):
            headers["Retry-After"] = "1"  # a slot frees within a reply; clients (the openai SDK) back off and retry
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


@contextmanager
def _request_errors(prompt_field: str) -> Iterator[None]:
    """A RequestError (webchat.serve.requests) as the API's 400 naming the field."""
    try:
        yield
    except RequestError as exc:
        if exc.kind == "messages":
            raise APIError(400, f"the chat template refused the messages: {exc.message}", "invalid_messages",
                           "messages") from None
        code = {"too_long": "context_length_exceeded", "limit": "context_length_exceeded",
                "unsupported": "unsupported_value", "image": "invalid_image"}.get(exc.kind, "invalid_value")
        field = prompt_field if exc.kind == "too_long" else exc.field
        raise APIError(400, exc.message, code, field) from None


def _json_body(content: Any) -> bytes:
    """JSON as Starlette's JSONResponse renders it."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def _format_field(req: ChatRequest | CompletionRequest) -> str:
    """The field a request's reply format came in."""
    return "structured_outputs" if req.structured_outputs is not None else "response_format"


def _raise_failure(event: ev.Event | None) -> None:
    if isinstance(event, ev.Failed):
        raise APIError(FAILED_STATUS.get(event.code, 400), event.message, event.code)
