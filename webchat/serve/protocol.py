"""The websocket message types of docs/protocol.md (version 1), validated strictly with pydantic."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

import annotated_types as at
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from webchat.engine import events as ev
from webchat.engine.settings import BIAS_RANGE, RANGES, Range, SamplingSettings, SettingsError, token_id
from webchat.serve.parts import PARTS, Content, check_tool_fields, neutral, text_of
from webchat.serve.replyformat import ResponseFormat
from webchat.serve.rules import loads, lone_surrogate, safe_text, short_repr
from webchat.serve.thinking import MAX_BUDGET
from webchat.serve.tools import MAX_TOOLS, ToolChoice

VERSION = 1
MAX_ALTERNATIVES = 20
MAX_PREFIX_IDS = 131_072  # a continued reply's token ids (the frame's size limit binds first)
MAX_TEMPLATE_KWARGS = 32
ERROR_CODES = (
    "bad_json", "bad_message", "bad_settings", "too_large", "prompt_too_long", "busy_connection", "busy", "internal",
    "upstream", "unknown_model", "model_too_large", "model_busy", "model_failed", "scoring_unavailable", "grammar",
    "load_limit", "unknown_tool", "tool_not_enabled", "bad_arguments", "bad_image",
)
MAX_TOOL_CALLS = 32  # calls in one assistant message
MAX_TOOL_ARGUMENTS = 64 * 1024  # a call's arguments, as JSON text
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# ---------------------------------------------------------------- client → server
def _within(name: str | Range) -> at.Interval:
    """A field's bounds from webchat.engine.settings' table (one home: the engine checks the same numbers)."""
    r = RANGES[name] if isinstance(name, str) else name
    return at.Interval(gt=r.lo if r.lo_open else None, ge=None if r.lo_open else r.lo, le=r.hi)


_DEFAULT = SamplingSettings()


class WireSettings(_Strict):
    """Sampling settings on the wire: the names, defaults and ranges of webchat.engine.settings.SamplingSettings."""

    temperature: Annotated[float, _within("temperature")] = _DEFAULT.temperature
    top_k: Annotated[int, _within("top_k")] = _DEFAULT.top_k
    top_p: Annotated[float, _within("top_p")] = _DEFAULT.top_p
    min_p: Annotated[float, _within("min_p")] = _DEFAULT.min_p
    typical_p: Annotated[float, _within("typical_p")] = _DEFAULT.typical_p
    repetition_penalty: Annotated[float, _within("repetition_penalty")] = _DEFAULT.repetition_penalty
    repetition_range: Annotated[int, _within("repetition_range")] = _DEFAULT.repetition_range
    frequency_penalty: Annotated[float, _within("frequency_penalty")] = _DEFAULT.frequency_penalty
    presence_penalty: Annotated[float, _within("presence_penalty")] = _DEFAULT.presence_penalty
    token_bias: Annotated[dict[str, Annotated[float, _within(BIAS_RANGE)]], Field(max_length=1000)] = Field(
        default_factory=dict
    )
    seed: Annotated[int, _within("seed")] | None = None

    @field_validator("token_bias")
    @classmethod
    def _bias_keys_are_ids(cls, v: dict[str, float]) -> dict[str, float]:
        for key in v:
            try:
                token_id(key)
            except SettingsError as exc:
                raise PydanticCustomError("bad_token_id", str(exc)) from None
        return v

    def token_bias_ids(self) -> dict[int, float]:
        return {int(k): b for k, b in self.token_bias.items()}


class ToolCallFunction(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: Annotated[str, Field(max_length=MAX_TOOL_ARGUMENTS)]  # JSON text, as the model wrote it


class ToolCall(_Strict):
    """A call an assistant message made (OpenAI's shape; docs/protocol.md, "Messages and their parts")."""

    id: Annotated[str, Field(min_length=1, max_length=128)]
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    """A message of a chat: its content text or parts (text, image_url: webchat.serve.parts); an assistant's tool
    calls; a tool message's result for the call it names."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Content
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        check_tool_fields(self.role, self.tool_calls, self.tool_call_id)
        return self

    @property
    def text(self) -> str:
        """The content's text (its text parts joined by newlines)."""
        return text_of(self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the request path takes it (webchat.serve.requests): content text, or neutral parts."""
        out: dict[str, Any] = {"role": self.role, "content": neutral(self.content)}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


RequestId = Annotated[str, Field(min_length=1, max_length=64)]
ToolName = Annotated[str, Field(min_length=1, max_length=64)]


class Generate(_Strict):
    type: Literal["generate"]
    id: RequestId
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1000)]
    settings: WireSettings = Field(default_factory=WireSettings)
    max_new_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 512
    stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=16)] = Field(
        default_factory=list
    )
    alternatives: Annotated[int, Field(ge=0, le=MAX_ALTERNATIVES)] = 0
    speculative: str | None = None  # None: the server's default mode
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # None: the server's default model
    continue_: bool = Field(default=False, alias="continue")  # the last message is a partial assistant reply
    # with continue: the final message's content as the token ids the model produced (a branch keeps the exact
    # tokens, never re-tokenised); the prompt is then the history's generation prompt followed by these ids
    prefix_ids: Annotated[list[int], Field(min_length=1, max_length=MAX_PREFIX_IDS)] | None = None
    # the reply's format (the API's response_format): text, any JSON object, or a JSON schema's instances
    response_format: ResponseFormat | None = None
    # more variables for the chat template (`enable_thinking`: the page's Think switch); webchat.serve.thinking
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None
    reasoning_budget: Annotated[int, Field(ge=-1, le=MAX_BUDGET)] | None = None  # None: --reasoning-budget; -1: none
    # the MCP tools this reply may call, by the names the `tools` message lists (only those: never a definition)
    tools: Annotated[list[ToolName], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None  # as the API's; needs `tools`; None: auto
    # an image's tiles at most (a vision model: webchat.serve.images); None: the server's --image-max-tiles
    image_max_tiles: Annotated[int, Field(ge=1, le=36)] | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _last_message_fits(self) -> Generate:
        last = self.messages[-1]
        if self.continue_ and (last.role != "assistant" or last.text.strip() == ""):
            got = f"role {last.role!r}" if last.role != "assistant" else "an empty assistant message"
            raise PydanticCustomError("last_not_user", "with continue the last message must be an assistant message "
                                      "with text, got {got}", {"got": got})
        if self.prefix_ids is not None and not self.continue_:
            raise PydanticCustomError("prefix_without_continue", "prefix_ids are the final assistant message's tokens: "
                                      "they need continue: true")
        bad = next((i for i, t in enumerate(self.prefix_ids or ()) if t < 0), None)
        if bad is not None:
            raise PydanticCustomError("prefix_ids", "prefix_ids[{i}] = {t} is not a token id (ids are >= 0)",
                                      {"i": bad, "t": (self.prefix_ids or [])[bad]})
        if not self.continue_ and last.role not in ("user", "tool"):
            raise PydanticCustomError("last_not_user", "the last message must be from the user (or a tool's result), "
                                      "got role {role}", {"role": repr(last.role)})
        return self


class Stop(_Strict):
    type: Literal["stop"]
    id: RequestId


class Score(_Strict):
    """Score a text as the model reads it (issue 41): the last of `messages` in its chat, or `text` alone; the reply
    is `scored` with that text's tokens (docs/protocol.md, "score")."""

    type: Literal["score"]
    id: RequestId
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1000)] | None = None
    text: Annotated[str, Field(min_length=1)] | None = None
    alternatives: Annotated[int, Field(ge=0, le=MAX_ALTERNATIVES)] = 5
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # None: the server's default model

    @model_validator(mode="after")
    def _one_text(self) -> Score:
        if (self.messages is None) == (self.text is None):
            raise PydanticCustomError("score_what", "give either 'messages' (score the last one in its chat) or "
                                      "'text' (score it alone), got {got}",
                                      {"got": "both" if self.text is not None else "neither"})
        if self.messages is not None and self.messages[-1].text.strip() == "":
            raise PydanticCustomError("score_what", "the last message is the one scored: it needs text")
        return self


class CallTool(_Strict):
    """Run one call the model made (issue 66): a tool the `tools` message listed and the last `generate` enabled, its
    arguments the JSON object text the model wrote; answered by `tool_result`, stopped by `stop` with this id."""

    type: Literal["call_tool"]
    id: RequestId
    name: ToolName
    arguments: Annotated[str, Field(max_length=MAX_TOOL_ARGUMENTS)]


ClientMessage = Generate | Stop | Score | CallTool
_CLIENT_TYPES: dict[str, type[Generate] | type[Stop] | type[Score] | type[CallTool]] = {
    "generate": Generate, "stop": Stop, "score": Score, "call_tool": CallTool}


# ---------------------------------------------------------------- server → client
class Hello(_Strict):
    type: Literal["hello"] = "hello"
    v: int = VERSION
    model: str
    context_length: int
    device: str
    dtype: str
    speculative: list[str]
    max_alternatives: int = MAX_ALTERNATIVES
    weights: str = "float32"  # what the matrices run as: "q4_1", "q8_0", ... (ggml blocks) or the float dtype
    precision: str = "exact"  # what the quantized matrices multiply at: "exact" (float32), "int8" or "int8x2"
    # on a remote engine (--engine-url): what it serves and gives the heatmap (webchat.serve.remote.capabilities)
    engine: dict[str, Any] | None = None
    # several local models (webchat.serve.models): each {name, size_bytes, architecture, weights, context_length,
    # default, loaded}; `model` above is the default, which a generate that names none runs on
    models: list[dict[str, Any]] | None = None
    # the model's thinking (webchat.serve.thinking.wire): {start, end, switch}; null where it does not think
    thinking: dict[str, Any] | None = None
    # the model reads images (--mmproj; webchat.serve.images.Vision.wire): {projector, image_size, tokens_per_tile,
    # max_tiles, max_images, formats}; null where it reads text only
    vision: dict[str, Any] | None = None


class Queued(_Strict):
    type: Literal["queued"] = "queued"
    id: str
    position: int


class Start(_Strict):
    type: Literal["start"] = "start"
    id: str
    prompt_tokens: int
    reused_tokens: int
    trimmed_messages: int | None = None  # present when the oldest messages were left out to fit the context


class Alternative(_Strict):
    id: int
    text: str
    p: float


class TokenOut(_Strict):
    id: int  # -1: the upstream engine did not say
    text: str
    p: float | None  # None: unknown (a remote engine that gave no probability)
    rank: int | None  # None: outside the top-k the engine returned, or unknown
    top: list[Alternative]
    sampled_p: float | None = None  # under the distribution drawn from (settings applied); None when unknown
    forbidden: list[int] | None = None  # ids in `top` the reply's format did not allow here (a constrained reply)
    part: Literal["thinking", "answer"] = Field(default="answer", exclude_if=lambda v: v == "answer")
    raw: str | None = Field(default=None, exclude_if=lambda v: v is None)  # the text written, where text differs


class Chunk(_Strict):
    type: Literal["chunk"] = "chunk"
    id: str
    text: str  # the answer's new text
    thinking: str = Field(default="", exclude_if=lambda v: v == "")  # the thinking's new text (before `text`)
    tokens: list[TokenOut] | None = None  # present only when the request asked for alternatives

    def merged(self, later: Chunk) -> Chunk:
        """This chunk followed by `later` (same request) as one chunk: texts joined, token lists concatenated."""
        tokens = None if self.tokens is None and later.tokens is None else (self.tokens or []) + (later.tokens or [])
        return Chunk.model_construct(type="chunk", id=self.id, text=self.text + later.text,
                                     thinking=self.thinking + later.thinking, tokens=tokens)


class Stats(_Strict):
    prompt_tokens: int = 0
    reused_tokens: int = 0
    new_tokens: int = 0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_tps: float = 0.0
    drafted: int = 0
    accepted: int = 0
    image_tokens: int = 0  # the prompt's image slots (in prompt_tokens too)
    encode_ms: float = 0.0  # encoding its images (in prefill_ms and ttft_ms too); 0 where they were cached


class Done(_Strict):
    type: Literal["done"] = "done"
    id: str
    reason: Literal["stop_token", "stop_string", "max_new_tokens", "context_full", "cancelled"]
    trigger: str | None = None
    stats: Stats
    # a reply that had tools: its calls as parsed ({id, type, function: {name, arguments}, span: [start, end]})
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=lambda v: v is None)


class Error(_Strict):
    type: Literal["error"] = "error"
    id: str | None
    code: Literal[
        "bad_json", "bad_message", "bad_settings", "too_large", "prompt_too_long", "busy_connection", "busy",
        "internal", "upstream", "unknown_model", "model_too_large", "model_busy", "model_failed",
        "scoring_unavailable", "grammar", "load_limit", "unknown_tool", "tool_not_enabled", "bad_arguments",
        "bad_image",
    ]
    message: str


class Loading(_Strict):
    """The request's model is being loaded (state "loading", with its size and the memory estimate), then is
    (state "loaded", the seconds it took and the models loaded now); the request then goes on as usual."""

    type: Literal["loading"] = "loading"
    id: str
    model: str
    state: Literal["loading", "loaded"]
    size_bytes: int | None = None
    estimate_bytes: int | None = None
    seconds: float | None = None
    loaded: list[str] | None = None


class Scored(_Strict):
    """A `score` request's answer: the scored text's tokens (`p` null for a first token nothing precedes), how many
    tokens the model read (its context included) and how long it took; the request ends here."""

    type: Literal["scored"] = "scored"
    id: str
    model: str
    tokens: list[TokenOut]
    stats: Stats


class Tools(_Strict):
    """The --mcp-config servers (issue 66): each one's state and tools; sent after `hello` and again on every change."""

    type: Literal["tools"] = "tools"
    servers: list[dict[str, Any]]
    max_result_chars: int  # a result's text is cut there, with a note


class ToolResult(_Strict):
    """A `call_tool`'s answer: the result as plain text (never HTML), or why there is none (`error`: a kind of
    webchat.mcp.result.ErrorKind, or `cancelled`), the text then saying so."""

    type: Literal["tool_result"] = "tool_result"
    id: str
    name: str
    text: str
    is_error: bool = False  # the tool reported a failure, or there is no result (`error`)
    error: str | None = None
    truncated: bool = False
    total_chars: int = 0
    ms: float = 0.0


ServerMessage = Hello | Queued | Start | Chunk | Done | Error | Loading | Scored | Tools | ToolResult


# ---------------------------------------------------------------- the websocket adapter of the worker's events
def event_messages(request_id: str, event: ev.Event, want_tokens: bool) -> list[ServerMessage]:
    """A neutral worker event (webchat.engine.events) as this protocol's messages for request `request_id`."""
    if isinstance(event, ev.Queued):
        return [Queued(id=request_id, position=event.position)]
    if isinstance(event, ev.Started):
        return [Start(id=request_id, prompt_tokens=event.prompt_tokens, reused_tokens=event.reused_tokens,
                      trimmed_messages=event.trimmed_messages or None)]
    if isinstance(event, ev.Tokens):
        if not event.text and not (want_tokens and event.tokens):
            return []
        tokens = [token_out(t) for t in event.tokens] if want_tokens else None
        return [Chunk(id=request_id, text=event.answer, thinking=event.thinking, tokens=tokens)]
    if isinstance(event, ev.Finished):
        return [Done(id=request_id, reason=event.reason, trigger=event.trigger,  # type: ignore[arg-type]
                     stats=stats_out(event.stats))]
    if isinstance(event, ev.PromptTokens):
        return []  # the websocket asks for no prompt scores yet
    return [Error(id=request_id, code=event.code, message=event.message)]  # type: ignore[arg-type]


def token_out(info: ev.TokenInfo) -> TokenOut:
    """A generated token as the wire's token entry (`p`: softmax of the raw logits; rank 1-based)."""
    top = [Alternative(id=int(tid), text=text, p=float(prob)) for tid, text, prob in info.top]
    sampled = None if info.sampled_prob is None else float(info.sampled_prob)
    return TokenOut(id=int(info.id), text=info.piece, p=None if info.prob is None else float(info.prob),
                    rank=None if info.rank is None else int(info.rank), top=top, sampled_p=sampled,
                    forbidden=[int(t) for t in info.forbidden] or None, part=info.part, raw=info.raw)


def stats_out(stats: ev.Stats) -> Stats:
    return Stats(prompt_tokens=stats.prompt_tokens, reused_tokens=stats.reused_tokens, new_tokens=stats.new_tokens,
                 prefill_ms=float(stats.prefill_ms), ttft_ms=float(stats.ttft_ms), decode_tps=float(stats.decode_tps),
                 drafted=stats.drafted, accepted=stats.accepted, image_tokens=stats.image_tokens,
                 encode_ms=float(stats.encode_ms))


def dump(msg: ServerMessage) -> str:
    """The JSON text frame for a server message (`chunk.tokens` left out when not asked for)."""
    if isinstance(msg, Chunk) and msg.tokens is None:
        return msg.model_dump_json(exclude={"tokens"})
    if isinstance(msg, Chunk | Scored) and all(t.forbidden is None for t in msg.tokens or []):
        return msg.model_dump_json(exclude={"tokens": {"__all__": {"forbidden"}}})  # a prompt's tokens: never any
    if isinstance(msg, Start) and msg.trimmed_messages is None:
        return msg.model_dump_json(exclude={"trimmed_messages"})
    if isinstance(msg, Loading):
        return msg.model_dump_json(exclude_none=True)
    return msg.model_dump_json()


# ---------------------------------------------------------------- parsing and errors
class ProtocolError(Exception):
    """A client frame that gets an `error` reply; `id` ties it to a request where the frame named one."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        assert code in ERROR_CODES, code
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id

    def to_message(self) -> Error:
        return Error(id=self.request_id, code=self.code, message=self.message)  # type: ignore[arg-type]


def parse_client_message(text: str | bytes, max_bytes: int) -> ClientMessage:
    """Decode and validate one client frame, or raise ProtocolError with the code of docs/protocol.md."""
    size = len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else len(text)
    if size > max_bytes:
        raise ProtocolError("too_large", f"frame is {size} bytes; the limit is {max_bytes} bytes")
    if isinstance(text, bytes):
        raise ProtocolError("bad_json", "expected a text frame holding a JSON object, got a binary frame")
    try:
        obj = loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("bad_json", f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_json", f"expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id") if isinstance(obj.get("id"), str) and 0 < len(obj["id"]) <= 64 else None
    if rid is not None and lone_surrogate(rid) is not None:
        raise ProtocolError("bad_message", "field 'id' holds a lone surrogate (an unpaired UTF-16 half, "
                                           "U+D800–U+DFFF), which no reply can echo", safe_text(rid))
    where = lone_surrogate(obj)
    if where is not None:
        raise ProtocolError("bad_message", f"field '{where}' holds a lone surrogate (an unpaired UTF-16 half, "
                                           "U+D800–U+DFFF): send well-formed Unicode text", rid)
    kind = obj.get("type")
    if kind not in _CLIENT_TYPES:
        got = "no 'type' field" if "type" not in obj else f"type {kind!r}"
        raise ProtocolError("bad_message", f"field 'type': expected one of {sorted(_CLIENT_TYPES)}, got {got}", rid)
    try:
        return _CLIENT_TYPES[kind].model_validate(obj)
    except ValidationError as exc:
        raise validation_error(exc, _CLIENT_TYPES[kind], rid) from None


def validation_error(exc: ValidationError, model: type[BaseModel], request_id: str | None) -> ProtocolError:
    """The first error of a ValidationError: `bad_settings` for a value out of range, else `bad_message`."""
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(part) for part in err["loc"] if part != PARTS) or "messages"  # whole-message check: the last
    if err["type"] in _RANGE_ERRORS:
        allowed = describe_range(model, err["loc"])
        return ProtocolError("bad_settings", f"{loc} = {err['input']!r} is out of range: allowed {allowed}", request_id)
    if err["type"] == "missing":
        return ProtocolError("bad_message", f"field '{loc}' is missing", request_id)
    if err["type"] == "extra_forbidden":
        return ProtocolError("bad_message", f"field '{loc}' is not part of the protocol", request_id)
    if err["type"] == "bad_token_id":
        return ProtocolError("bad_settings", f"{loc}: {err['msg']}", request_id)
    if err["type"] in ("prefix_ids", "prefix_without_continue"):  # whole-message checks of one field
        return ProtocolError("bad_message", f"field 'prefix_ids': {err['msg']}", request_id)
    if err["type"] in ("last_not_user", "score_what"):
        return ProtocolError("bad_message", f"field '{loc}': {err['msg']}", request_id)
    shown = short_repr(err.get("input"))
    return ProtocolError("bad_message", f"field '{loc}': {err['msg']}, got {shown}", request_id)


def describe_range(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """The bounds declared on the field at `loc`, e.g. '0.0 <= value <= 10.0'."""
    metadata = [c for m in _field_metadata(model, loc) for c in (m if isinstance(m, at.GroupedMetadata) else [m])]
    lo = next((f"{m.ge} <=" for m in metadata if isinstance(m, at.Ge)), None)
    lo = lo or next((f"{m.gt} <" for m in metadata if isinstance(m, at.Gt)), None)
    hi = next((f"<= {m.le}" for m in metadata if isinstance(m, at.Le)), None)
    hi = hi or next((f"< {m.lt}" for m in metadata if isinstance(m, at.Lt)), None)
    return " ".join(part for part in (lo, "value", hi) if part)


def _field_metadata(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[Any]:
    current: Any = model
    metadata: list[Any] = []
    for part in loc:
        if isinstance(current, type) and issubclass(current, BaseModel) and isinstance(part, str):
            if part not in current.model_fields:
                return []
            info = current.model_fields[part]
            metadata, current = list(info.metadata), info.annotation
        else:  # inside a dict or list: the element (value) type
            args = getattr(current, "__args__", ())
            current, metadata = (args[-1] if args else None), []
        current, metadata = _unwrap(current, metadata)
    return metadata


def _unwrap(tp: Any, metadata: list[Any]) -> tuple[Any, list[Any]]:
    """Strip Optional and Annotated from a type, collecting constraint objects (FieldInfo expanded)."""
    while True:
        args = [a for a in getattr(tp, "__args__", ()) if a is not type(None)]
        if getattr(tp, "__metadata__", None):
            for m in tp.__metadata__:
                metadata.extend(m.metadata if isinstance(m, FieldInfo) else [m])
            tp = tp.__origin__
        elif typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
            tp = args[0]
        else:
            return tp, metadata
