"""One request path for both wires: a request from the websocket or `/v1`, described once (a Turn to generate, a Text
to complete, a Score), becomes the job that runs it through the model's Preparer, local or remote, which the front
ends call without asking which (vLLM's one preprocessor behind every route; llama.cpp's `server_task`).

    turn = Turn(messages, settings, max_new_tokens=..., thinking=Ask(...), reply_format=..., tools=...)
    prepared = await runtime.prep.chat(turn)          # RequestError(kind, field, message) when it cannot run
    job = prepared.job(key, request_id, deliver, client, model)

Locally (LocalPreparer) a Turn is templated (its tools and thinking in it), tokenized off the event loop, fitted to
the context (the page's older messages left out; the API's refused), its reply format or tools compiled into a
grammar on a compiler thread, a kept reply replayed into it, and its thinking's split and budget set; the result is a
GenerationRequest. A remote engine (webchat.serve.remote.prepare) sends the chat as it is, with the client's format
and tools within webchat's grammar bounds. Each wire words a RequestError in its own shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import jinja2

from webchat.engine import events as ev
from webchat.engine.images import ImageInput
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings, SettingsError, check_token_ids
from webchat.grammar.matcher import GrammarConstraint
from webchat.serve import thinking
from webchat.serve.backend import Job, Scoring
from webchat.serve.encode import encode_text_work, text_chars
from webchat.serve.images import ImagePartError, Pictures, Vision
from webchat.serve.parts import images_in, text_of
from webchat.serve.replyformat import grammar_work, kept_ids, make_constraint
from webchat.serve.rules import RuleError, context_room, short_repr, speculative_mode
from webchat.serve.tools import ToolPlan, Tools, chat_tools
from webchat.text.chat_encode import ContentRewritten
from webchat.text.detok import decode_all
from webchat.text.thinking import for_template, thinking_format
from webchat.text.trim import fit_history, kept_messages

if TYPE_CHECKING:
    from webchat.text.tokenizer import Tokenizer

Kind = Literal["settings", "messages", "too_long", "limit", "format", "prefix", "unsupported", "image"]


class RequestError(Exception):
    """A request that cannot run as asked. kind: settings (a value out of range), messages (the chat template refused
    them), too_long (no room for one new token), limit (the tokens asked for pass the context), format (a reply
    format or tools it cannot have), prefix (prefix_ids that are not the final message), unsupported (what this
    engine cannot do), image (an image part that cannot be read). `field` names the input on the wire."""

    def __init__(self, kind: Kind, field: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.field, self.message = kind, field, message


Settings = Callable[[int], SamplingSettings]  # the request's settings for a vocabulary size (SettingsError on a bad id)


@dataclass
class Turn:
    """A chat to continue, as both wires ask it."""

    messages: list[dict[str, Any]]  # as the chat template reads them
    settings: Settings
    max_new_tokens: int | None  # None: as many as the context leaves
    fit: bool  # True: older messages are left out to fit the context (the page); False: refused (the API)
    stop: list[str] = field(default_factory=list)
    top_alts: int = 0
    want_probs: bool = False
    speculative: str | None = None  # None: the server's default mode
    continue_final: bool = False  # the last message is an assistant reply to go on with
    prefix_ids: list[int] | None = None  # that reply as the model's token ids (a branch)
    add_generation_prompt: bool = True  # False with prompt_logprobs: the chat scored as it stands
    thinking: thinking.Ask = field(default_factory=thinking.Ask)
    reply_format: Callable[[], str | None] | None = None  # the format's grammar, built on a compiler thread
    format_field: str = "response_format"
    tools: Tools | None = None
    prompt_logprobs: int | None = None
    upstream: dict[str, Any] | None = None  # the client's format and tools as sent (a remote engine passes them on)
    image_max_tiles: int | None = None  # an image's tiles at most (webchat.serve.images); None: the server's default


@dataclass
class Text:
    """A prompt to complete (/v1/completions): text or token ids."""

    prompt: str | list[int]
    settings: Settings
    max_new_tokens: int | None
    stop: list[str] = field(default_factory=list)
    top_alts: int = 0
    want_probs: bool = False
    speculative: str | None = None
    reply_format: Callable[[], str | None] | None = None
    format_field: str = "response_format"
    prompt_logprobs: int | None = None


@dataclass
class Score:
    """A text read by the model (the websocket's `score`): the last message in its chat, or a text alone."""

    alternatives: int
    messages: list[dict[str, Any]] | None = None
    text: str | None = None


@dataclass
class Prepared:
    """A request ready to run: the generator request and what its Job carries."""

    request: GenerationRequest
    prompt_tokens: int = 0
    trimmed: int = 0  # older messages left out to fit
    messages: list[dict[str, Any]] | None = None  # the chat (a remote engine sends it)
    continue_final: bool = False
    prefix_ids: list[int] | None = None
    thinking: thinking.Ask | None = None
    plan: ToolPlan | None = None  # the tools in play (the API parses its reply's calls by it)
    tools_format: bool = False  # tools go upstream as the client sent them (the reply's calls parsed generically)
    upstream: dict[str, Any] | None = None
    scoring: Scoring | None = None
    echo: str = ""  # a completion's prompt as text (the legacy echo)

    def job(self, key: Hashable, request_id: str, deliver: Callable[[ev.Event], None], client: Hashable,
            model: str | None) -> Job:  # fmt: skip
        return Job(key=key, request_id=request_id, request=self.request, deliver=deliver,
                   prompt_tokens=self.prompt_tokens, client=client, messages=self.messages,
                   continue_final=self.continue_final, prefix_ids=self.prefix_ids, model=model, scoring=self.scoring,
                   upstream=self.upstream, thinking=self.thinking)


class Preparer(Protocol):
    """Turns requests into jobs for one model: LocalPreparer, or the remote engine's."""

    async def chat(self, turn: Turn) -> Prepared: ...
    async def text(self, text: Text) -> Prepared: ...
    async def score(self, score: Score) -> Prepared: ...
    async def tokens(self, messages: list[dict[str, Any]] | None, prompt: str | None, add_generation_prompt: bool,
                     continue_final: bool, kwargs: dict[str, Any]) -> list[int]: ...  # fmt: skip


class LocalPreparer:
    """The local model's request path: its tokenizer, vocabulary, context and speculative modes."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, context_length: int, default_mode: str,
                 modes: list[str], vision: Vision | None = None) -> None:  # fmt: skip
        self.tokenizer, self.vocab_size, self.context = tokenizer, vocab_size, context_length
        self.default_mode, self.modes = default_mode, modes
        self.vision = vision  # a vision model's projector (webchat.serve.images); None: images are refused

    # ------------------------------------------------------------ a chat
    async def chat(self, turn: Turn) -> Prepared:
        pictures = await self._pictures(turn.messages, turn.image_max_tiles)
        settings = self._settings(turn.settings)
        mode = self._mode(turn.speculative)
        if turn.prefix_ids is not None:
            self._check_prefix(turn)
        messages, template_tools, plan = turn.messages if pictures is None else pictures.messages, None, None
        if turn.tools is not None:
            messages, template_tools, plan = await _format_work(
                chat_tools, messages, turn.tools, self.tokenizer.chat_template, self.tokenizer.control_id,
                field="tools")
        grammar = plan.grammar if plan is not None else None
        if turn.reply_format is not None:
            asked = await _format_work(turn.reply_format, field=turn.format_field)
            if grammar is not None and asked is not None:
                raise RequestError("format", "response_format", "a reply format cannot be combined with tools that "
                                   "may be called; send tool_choice 'none', or leave the format out")
            grammar = grammar if grammar is not None else asked
        chars = text_chars(messages, template_tools or (plan.tools if plan is not None else None))
        ids, trimmed = await self._chat_ids(turn, messages, template_tools, chars, pictures)
        images = [] if pictures is None else self._images(pictures, ids, kept_messages(messages, trimmed))
        room = self._room(len(ids), turn.fit)
        limit = turn.max_new_tokens if turn.max_new_tokens is not None else room
        if not turn.fit and limit > room:
            raise RequestError("limit", "max_tokens", f"this model's context is {self.context} tokens; the request "
                               f"needs {len(ids) + limit} ({len(ids)} in the prompt, {limit} to generate)")
        reasoning = await self._template_work(thinking.thinking_for, self.tokenizer, messages, turn.continue_final,
                                              turn.thinking, chars=chars)
        kept = turn.prefix_ids
        if kept is None and turn.continue_final:  # a continued reply goes on under the format
            kept = kept_ids(self.tokenizer, text_of(messages[-1].get("content")))
        field_name = "tools" if plan is not None else turn.format_field
        request = GenerationRequest(prompt_ids=ids, settings=settings, max_new_tokens=limit, stop_strings=turn.stop,
                                    return_probs=turn.want_probs, top_alts=turn.top_alts, speculative=mode,
                                    thinking=reasoning, prompt_logprobs=turn.prompt_logprobs, images=images,
                                    constraint=await self._constraint(grammar, field_name, kept))
        return Prepared(request, len(ids), trimmed, messages, turn.continue_final, turn.prefix_ids, turn.thinking,
                        plan)

    async def _chat_ids(self, turn: Turn, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        chars: int, pictures: Pictures | None = None) -> tuple[list[int], int]:  # fmt: skip
        """The prompt ids and how many older messages were left out (the page's chats fit the context)."""
        encode = functools.partial(self._encode, continue_final=turn.continue_final, prefix_ids=turn.prefix_ids,
                                   add=turn.add_generation_prompt, kwargs=turn.thinking.kwargs, tools=tools,
                                   pictures=pictures)
        if not turn.fit:
            return await self._template_work(encode, messages, chars=chars), 0
        budget = max(self.context - (turn.max_new_tokens or 0), 1)
        fitted = await self._template_work(fit_history, encode, messages, budget, chars=chars)
        return fitted.ids, fitted.dropped

    def _encode(self, messages: list[dict[str, Any]], continue_final: bool, prefix_ids: list[int] | None, add: bool,
                kwargs: dict[str, Any], tools: list[dict[str, Any]] | None,
                pictures: Pictures | None = None) -> list[int]:  # fmt: skip
        """The chat's prompt (its thinking, tools and images too), or without the generation prompt (a chat scored as
        it stands)."""
        kwargs = {**kwargs, **({"tools": tools} if tools else {})}
        expand = pictures.expander(messages) if pictures is not None else None
        if add or continue_final or prefix_ids is not None:
            ids = thinking.encode_chat(self.tokenizer, messages, continue_final, prefix_ids, kwargs, expand)
        else:
            ids = self.tokenizer.encode_chat(for_template(messages, thinking_format(self.tokenizer)), False,
                                             expand=expand, **kwargs)
        if expand is not None:
            expand.check()
        return ids

    async def tokens(self, messages: list[dict[str, Any]] | None, prompt: str | None, add_generation_prompt: bool,
                     continue_final: bool, kwargs: dict[str, Any]) -> list[int]:  # fmt: skip
        """The prompt ids a chat (as a Turn is templated) or a text would run on (vLLM's /tokenize)."""
        if messages is not None:
            pictures = await self._pictures(messages, None)
            messages = messages if pictures is None else pictures.messages
            encode = functools.partial(self._encode, continue_final=continue_final, prefix_ids=None,
                                       add=add_generation_prompt, kwargs=kwargs, tools=None, pictures=pictures)
            ids: list[int] = await self._template_work(encode, messages, chars=text_chars(messages))
            return ids
        return await encode_text_work(self.tokenizer.encode_text, prompt or "", chars=len(prompt or ""))

    # ------------------------------------------------------------ a raw prompt
    async def text(self, text: Text) -> Prepared:
        settings = self._settings(text.settings)
        mode = self._mode(text.speculative)
        if isinstance(text.prompt, str):
            ids = await encode_text_work(self.tokenizer.encode_text, text.prompt, chars=len(text.prompt))
            echo = text.prompt
        else:
            try:
                check_token_ids(text.prompt, self.vocab_size, "each prompt token id")
            except SettingsError as exc:
                raise RequestError("settings", "prompt", str(exc)) from None
            ids, echo = list(text.prompt), decode_all(self.tokenizer.token_bytes, text.prompt)
        grammar = None if text.reply_format is None else await _format_work(text.reply_format, field=text.format_field)
        if not ids:
            raise RequestError("settings", "prompt", "the prompt is empty: it encodes to no tokens")
        room = self._room(len(ids), False, "prompt")
        limit = text.max_new_tokens if text.max_new_tokens is not None else room
        if limit > room:
            raise RequestError("limit", "max_tokens", f"this model's context is {self.context} tokens; the request "
                               f"needs {len(ids) + limit} ({len(ids)} in the prompt, {limit} to generate)")
        request = GenerationRequest(prompt_ids=ids, settings=settings, max_new_tokens=limit, stop_strings=text.stop,
                                    return_probs=text.want_probs, top_alts=text.top_alts, speculative=mode,
                                    prompt_logprobs=text.prompt_logprobs,
                                    constraint=await self._constraint(grammar, text.format_field, None))
        return Prepared(request, len(ids), echo=echo)

    # ------------------------------------------------------------ a text scored
    async def score(self, score: Score) -> Prepared:
        """The text read in one prefill (greedy, nothing generated, every prompt position scored)."""
        found = images_in(score.messages or [])
        if found and self.vision is not None:
            raise RequestError("unsupported", found[0][0], f"{found[0][0]} is an image: scoring a chat that holds "
                               "images is not done (score its text alone)")
        refuse_images(score.messages or [])
        target = score.text if score.text is not None else text_of((score.messages or [{}])[-1].get("content"))
        if score.text is not None:
            ids = await encode_text_work(self.tokenizer.encode_text, score.text, chars=len(score.text))
        else:
            history = score.messages or []
            encode = functools.partial(self.tokenizer.encode_chat, add_generation_prompt=False)
            fitted = await self._template_work(fit_history, encode, history, self.context, chars=text_chars(history))
            ids = fitted.ids
        if not ids or len(ids) > self.context:
            raise RequestError("too_long", "text", f"the text to score is {len(ids)} tokens; this model reads at most "
                               f"{self.context}")
        request = GenerationRequest(prompt_ids=ids, settings=SamplingSettings(temperature=0.0), max_new_tokens=0,
                                    prompt_logprobs=score.alternatives)
        return Prepared(request, len(ids), messages=score.messages,
                        scoring=Scoring(target=target, text=score.text is not None))

    # ------------------------------------------------------------ images
    async def _pictures(self, messages: list[dict[str, Any]], max_tiles: int | None) -> Pictures | None:
        """The chat's images decoded and planned (webchat.serve.images); None where it holds none; refused by name on
        a model that reads text only."""
        if not images_in(messages):
            return None
        if self.vision is None:
            refuse_images(messages)
        assert self.vision is not None
        try:
            return await self.vision.prepare(messages, max_tiles)
        except ImagePartError as exc:
            raise RequestError("image", exc.field, exc.message) from None

    @staticmethod
    def _images(pictures: Pictures, ids: list[int], kept: list[dict[str, Any]]) -> list[ImageInput]:
        """The kept images' slots in the prompt (the template put each marker where its image goes)."""
        try:
            return pictures.inputs(ids, kept)
        except ValueError as exc:
            raise RequestError("messages", "messages", str(exc)) from None

    # ------------------------------------------------------------ checks
    def _settings(self, settings: Settings) -> SamplingSettings:
        try:
            return settings(self.vocab_size)
        except SettingsError as exc:
            raise RequestError("settings", f"settings.{exc.field}", f"settings.{exc}") from None

    def _mode(self, asked: str | None) -> str:
        try:
            return speculative_mode(asked, self.default_mode, self.modes)
        except RuleError as exc:
            raise RequestError("settings", exc.field, exc.message) from None

    def _room(self, prompt_tokens: int, fit: bool, field_name: str = "messages") -> int:
        """Tokens the context leaves after the prompt; too_long when not even one."""
        try:
            return context_room(prompt_tokens, self.context)
        except RuleError as exc:
            more = " (older messages are left out to fit, the system prompt and the latest message are not)"
            raise RequestError("too_long", field_name, exc.message + (more if fit else "")) from None

    def _check_prefix(self, turn: Turn) -> None:
        """prefix_ids inside the vocabulary and spelling the final message's content."""
        ids = turn.prefix_ids or []
        try:
            check_token_ids(ids, self.vocab_size, "prefix_ids")
        except SettingsError as exc:
            raise RequestError("prefix", "prefix_ids", f"field 'prefix_ids': {exc}") from None
        text, content = decode_all(self.tokenizer.token_bytes, ids), text_of(turn.messages[-1].get("content"))
        if text != content:
            at = next((i for i, (a, b) in enumerate(zip(text, content, strict=False)) if a != b),
                      min(len(text), len(content)))
            raise RequestError("prefix", "prefix_ids", f"field 'prefix_ids': the {len(ids)} ids spell "
                               f"{short_repr(text)}, the final message is {short_repr(content)} (they differ from "
                               f"character {at}); they must be that message's tokens")

    async def _template_work(self, fn: Callable[..., Any], *args: Any, chars: int) -> Any:
        """A render of the chat template off the event loop past a few kilobytes; its errors as `messages`."""
        try:
            return await encode_text_work(fn, *args, chars=chars)
        except (jinja2.TemplateError, ContentRewritten, ValueError, ArithmeticError) as exc:
            field_name = "continue" if isinstance(exc, ContentRewritten) else "messages"
            raise RequestError("messages", field_name, f"{type(exc).__name__}: {exc}") from None

    async def _constraint(self, grammar: str | None, field_name: str,
                          kept: list[int] | None) -> GrammarConstraint | None:  # fmt: skip
        try:
            return await make_constraint(self.tokenizer, self.vocab_size, grammar, field_name, kept or None)
        except RuleError as exc:
            raise RequestError("format", exc.field, exc.message) from None


def refuse_images(messages: list[dict[str, Any]]) -> None:
    """A model that reads text refuses an image part by name (a vision model's Preparer takes them)."""
    found = images_in(messages)
    if found:
        raise RequestError("unsupported", found[0][0], f"{found[0][0]} is an image: this model reads text only (a "
                           "vision model reads images: its GGUF served with --mmproj, docs/vision.md)")


async def _format_work(fn: Callable[..., Any], *args: Any, field: str) -> Any:
    """Grammar work (a reply format, a request's tools) on a compiler thread; its refusals as `format`."""
    try:
        return await grammar_work(fn, *args, field=field)
    except RuleError as exc:
        raise RequestError("format", exc.field, exc.message) from None
