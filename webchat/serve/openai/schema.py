"""The OpenAI API's request bodies (docs/api.md), validated strictly with pydantic, and its error shape."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from webchat.engine.settings import MAX_TOP_ALTS, SamplingSettings, SettingsError, token_id
from webchat.serve.openai.structured import ResponseFormat, StructuredOutputs
from webchat.serve.openai.thinking import FORMATS
from webchat.serve.parts import PARTS, Content, check_tool_fields, neutral
from webchat.serve.rules import loads, lone_surrogate, safe_text, short_repr
from webchat.serve.thinking import Ask, budget_value, check_kwargs
from webchat.serve.tools import Tool, ToolCall, ToolChoice

MAX_STOPS = 16
MAX_STOP_CHARS = 200
MAX_BIAS = 1000
# webchat's own defaults are tuned for chat (webchat.engine.sampling); the API keeps OpenAI's: plain sampling at T = 1
OPENAI_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
             415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
             502: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _union(v: Any, handler: ValidatorFunctionWrapHandler, expected: str) -> Any:
    """Validate a union field; its failure is one message naming what was expected, not one per member."""
    try:
        return handler(v)
    except ValidationError:
        raise PydanticCustomError("expected", "expected {expected}", {"expected": expected}) from None




class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None  # null only on an assistant message that carries tool_calls
    name: str | None = None  # accepted and ignored
    # an assistant's thinking (llama-server's and DeepSeek's name; vLLM's `reasoning`): the template keeps or drops it
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made (docs/api.md, "Tools")
    tool_call_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None  # tool: the call it answers
    refusal: str | None = None  # accepted and ignored (the official client sends it back)

    @model_validator(mode="after")
    def _content_or_calls(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("content", "content is required unless an assistant message has tool_calls, "
                                      "got null on a {role} message", {"role": repr(self.role)})
        check_tool_fields(self.role, self.tool_calls, self.tool_call_id)
        return self

    def for_template(self) -> dict[str, Any]:
        """role/content as the chat template reads them: developer → system, text parts joined by newlines (image parts
        kept as parts, webchat.serve.parts); an
        assistant's calls and a tool result's call id kept (webchat.text.toolformat shapes them per format); an
        assistant's thinking as `reasoning_content`."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": neutral(self.content) if self.content is not None else None}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if self.role == "assistant" and thinking is not None:
            out["reasoning_content"] = thinking
        return out


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Request(_Strict):
    """Fields both endpoints share; None everywhere means the default (clients often send explicit nulls)."""

    model: str
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: scoring only (echo or prompt_logprobs)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    user: str | None = None  # accepted and ignored
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_BIAS)] | None = None
    # webchat's extensions (vLLM accepts its own the same way)
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    repetition_range: int | None = None
    speculative: str | None = None
    return_token_ids: bool | None = None  # vLLM's extension: each choice carries its tokens' ids as `token_ids`
    # vLLM's extension: each prompt token after the first with its logprob, rank and this many alternatives
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_ALTS)] | None = None
    # the reply's format (docs/api.md, "Structured output"): OpenAI's, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop(cls, v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _union(v, handler, "a string or a list of strings")

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"stop holds {len(stops)} strings; at most {MAX_STOPS} are allowed", "invalid_value",
                           "stop")
        for s in stops:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise APIError(400, f"each stop string must be 1 to {MAX_STOP_CHARS} characters, got {len(s)}",
                               "invalid_value", "stop")
        return stops

    def check_common(self) -> None:
        if self.n not in (None, 1):
            raise APIError(400, f"n must be 1: webchat generates one choice per request, got {self.n}",
                           "invalid_value", "n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "invalid_value", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs are not available with stream: true (as in vLLM); ask without "
                           "streaming, or use /v1/completions with echo", "invalid_value", "prompt_logprobs")

    def scored(self) -> int | None:
        """Alternatives per prompt token the engine scores (GenerationRequest.prompt_logprobs); None: not scored."""
        return self.prompt_logprobs

    def check_limit(self, limit: int | None, scoring: bool) -> None:
        """0 tokens to generate only where the request scores its prompt (pure scoring)."""
        if limit == 0 and not scoring:
            raise APIError(400, "max_tokens 0 generates nothing: it needs echo: true or prompt_logprobs (scoring "
                           "the prompt only), got neither", "invalid_value", "max_tokens")

    def sampling(self, vocab_size: int) -> SamplingSettings:
        """The sampling settings, OpenAI's defaults where a field is left out; ranges are SamplingSettings' own."""
        names = ("temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty", "repetition_range",
                 "frequency_penalty", "presence_penalty", "seed")
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        bias: dict[int, float] = {}
        try:
            for key, value in (self.logit_bias or {}).items():
                bias[token_id(key, vocab_size, "logit_bias key")] = value
            return SamplingSettings(**{**OPENAI_DEFAULTS, **given}, token_bias=bias)
        except SettingsError as exc:
            param = "logit_bias" if exc.field.startswith(("token_bias", "logit_bias")) else exc.field
            raise APIError(400, str(exc).replace("token_bias", "logit_bias"), "invalid_value", param) from None


R = TypeVar("R", bound=_Strict)


def template_kwargs(given: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs, checked (webchat.text.thinking.check_kwargs): 400 naming the key."""
    kwargs = dict(given or {})
    try:
        check_kwargs(kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_value", "chat_template_kwargs") from None
    return kwargs


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_ALTS)] | None = None
    # vLLM's and SGLang's extension: continue the final assistant message instead of starting a new one
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _tool_choice(cls, v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _union(v, handler, "'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}")

    # thinking (serve/openai/thinking.py): template variables (vLLM's, SGLang's, llama-server's name), llama-server's
    # reasoning_format and reasoning budget; vLLM's name for the budget
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32)] | None = None
    reasoning_format: str | None = None
    reasoning_budget_tokens: int | None = None
    reasoning_budget_message: Annotated[str, Field(max_length=1000)] | None = None
    thinking_token_budget: int | None = None
    # an image's tiles at most (webchat's extension, the websocket's generate.image_max_tiles); None: the server's
    image_max_tiles: Annotated[int, Field(ge=1, le=36)] | None = None

    def thinking(self, default_budget: int | None) -> Ask:
        """What the request asks of thinking, checked: 400 naming the field."""
        kwargs = template_kwargs(self.chat_template_kwargs)
        if self.reasoning_format not in (None, *FORMATS):
            raise APIError(400, f"reasoning_format must be one of {', '.join(FORMATS)}, got {self.reasoning_format!r}",
                           "invalid_value", "reasoning_format")
        names = ("reasoning_budget_tokens", "thinking_token_budget")
        given = {k: v for k in names if (v := getattr(self, k)) is not None}
        if len(set(given.values())) > 1:
            raise APIError(400, f"reasoning_budget_tokens and thinking_token_budget name one budget; got {given}",
                           "invalid_value", "thinking_token_budget")
        name, value = next(iter(given.items()), ("reasoning_budget_tokens", None))
        try:
            budget = budget_value(value, default_budget)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value", name) from None
        return Ask(kwargs=kwargs, budget=budget, message=self.reasoning_budget_message or "",
                   split=self.reasoning_format != "none")

    def check(self) -> None:
        self.check_common()
        if self.continue_final_message:
            if self.add_generation_prompt is not False:
                raise APIError(400, "continue_final_message: true needs add_generation_prompt: false, got "
                               f"{self.add_generation_prompt}", "invalid_value", "add_generation_prompt")
            if self.messages[-1].role != "assistant":
                raise APIError(400, "continue_final_message: true needs the last message to be the assistant's, got "
                               f"{self.messages[-1].role!r}", "invalid_value", "messages")
        elif self.add_generation_prompt is False and self.prompt_logprobs is None:
            raise APIError(400, "add_generation_prompt: false is only supported with continue_final_message: true "
                           "or prompt_logprobs (a chat scored as it stands)", "unsupported_value",
                           "add_generation_prompt")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, f"top_logprobs = {self.top_logprobs} needs logprobs: true, got logprobs = "
                           f"{self.logprobs}", "invalid_value", "top_logprobs")
        self.check_limit(self.limit(), self.prompt_logprobs is not None)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_Request):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_ALTS)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _union(v, handler, "a string, a list of token ids, or a list holding one of either")

    def check(self) -> None:
        self.check_common()
        self.check_limit(self.max_tokens, bool(self.echo) or self.prompt_logprobs is not None)
        if self.suffix:
            raise APIError(400, "suffix is not supported (no fill-in-the-middle), got a suffix", "unsupported_value",
                           "suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of must be 1, got {self.best_of}", "invalid_value", "best_of")

    def scored(self) -> int | None:
        """How many alternatives the engine gives each prompt token (GenerationRequest.prompt_logprobs); None: the
        prompt is not scored. `prompt_logprobs`, and with echo the legacy `logprobs` (vLLM reads echo so); echo alone
        with nothing to generate still runs the prompt (0)."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else 0 if self.echo and self.max_tokens == 0 else None

    def one_prompt(self) -> str | list[int]:
        """The single prompt: text, or token ids; a list of several prompts is refused (one choice per request)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise APIError(400, f"prompt holds {len(p)} prompts; webchat takes one per request", "invalid_value",
                               "prompt")
            return p[0]
        return p  # type: ignore[return-value]


class TokenizeRequest(_Strict):
    """POST /tokenize, in vLLM's shape: a text `prompt`, or chat `messages` as the chat endpoint would template them."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_generation_prompt: bool | None = None  # messages: default true
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None  # accepted; webchat's chat prompts carry the template's own markers
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32)] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either 'prompt' (text) or 'messages' (a chat), not "
                           + ("both" if self.prompt is not None else "neither"), "invalid_value",
                           "prompt" if self.prompt is not None else "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message: true needs add_generation_prompt: false", "invalid_value",
                           "add_generation_prompt")


# ---------------------------------------------------------------- parsing
def parse(model: type[R], body: bytes) -> R:
    """Decode and validate a request body, or raise APIError 400 naming the field (`param`) and the problem."""
    try:
        obj = loads(body)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(obj).__name__}", "invalid_json")
    where = lone_surrogate(obj)
    if where is not None:
        raise APIError(400, f"field '{safe_text(where)}' holds a lone surrogate (an unpaired UTF-16 half, "
                            "U+D800–U+DFFF): send well-formed Unicode text", "invalid_value", safe_text(where))
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise invalid(exc) from None


def invalid(exc: ValidationError) -> APIError:
    """The first error of a ValidationError as a 400: param = the field's dotted path."""
    err = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in err["loc"] if part != PARTS)
    if err["type"] == "missing":
        return APIError(400, f"field '{param}' is required", "missing_required_parameter", param)
    if err["type"] == "extra_forbidden":
        return APIError(400, f"field '{param}' is not supported by webchat's API (docs/api.md lists the fields)",
                        "unknown_parameter", param)
    return APIError(400, f"field '{param}': {err['msg']}, got {short_repr(err.get('input'))}", "invalid_value", param)
