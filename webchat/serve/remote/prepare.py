"""The request path on a remote engine (webchat.serve.requests' Preparer for `--engine-url`): a chat goes upstream as
its messages, with the client's reply format and tools as sent, within webchat's grammar bounds and what the upstream
was found to take; the upstream templates, counts and enforces."""

from __future__ import annotations

from typing import Any

from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings, SettingsError
from webchat.serve.backend import Scoring
from webchat.serve.parts import images_in, openai_form, text_of
from webchat.serve.remote.capabilities import Capabilities
from webchat.serve.replyformat import grammar_work, upstream_bounds
from webchat.serve.requests import Prepared, RequestError, Score, Settings, Text, Turn, refuse_images
from webchat.serve.rules import RuleError, speculative_mode

UNAVAILABLE = "scoring needs an engine with prompt logprobs"


class RemotePreparer:
    """A remote engine's side of the request path; `caps` reads the upstream's last probe."""

    def __init__(self, caps: Any) -> None:
        self._caps = caps  # a callable returning the RemoteEngine's current Capabilities

    @property
    def caps(self) -> Capabilities:
        caps: Capabilities = self._caps()
        return caps

    async def chat(self, turn: Turn) -> Prepared:
        messages = self._images(turn.messages)
        if turn.prompt_logprobs is not None:
            raise RequestError("unsupported", "prompt_logprobs", "prompt scores (prompt_logprobs, echo) are not "
                               "forwarded to the remote engine; ask the upstream itself")
        settings = _settings(turn.settings)
        try:
            mode = speculative_mode(turn.speculative, "none", ["none"])
        except RuleError as exc:
            raise RequestError("settings", exc.field, exc.message) from None
        upstream = turn.upstream
        if upstream:
            self._takes(upstream)
            try:
                await grammar_work(upstream_bounds, upstream, field="tools" if upstream.get("tools") else
                                   "response_format")
            except RuleError as exc:
                raise RequestError("format", exc.field, exc.message) from None
        request = GenerationRequest(prompt_ids=[], settings=settings, max_new_tokens=turn.max_new_tokens or 0,
                                    stop_strings=turn.stop, return_probs=turn.want_probs, top_alts=turn.top_alts,
                                    speculative=mode)
        return Prepared(request, messages=messages, continue_final=turn.continue_final,
                        prefix_ids=turn.prefix_ids, thinking=turn.thinking, upstream=upstream,
                        tools_format=bool(upstream and upstream.get("tools")))

    async def text(self, text: Text) -> Prepared:
        raise RequestError("unsupported", "prompt", "text completions are not forwarded to the remote engine; use "
                           "/v1/chat/completions")

    async def score(self, score: Score) -> Prepared:
        caps = self.caps
        if caps.prompt_logprobs == "absent":
            raise RequestError("unsupported", "score", f"{UNAVAILABLE}: the upstream at {caps.url} ({caps.kind}) "
                               "returns none (vLLM and webchat do)")
        refuse_images(score.messages or [])
        target = score.text if score.text is not None else text_of((score.messages or [{}])[-1].get("content"))
        request = GenerationRequest(prompt_ids=[], settings=SamplingSettings(temperature=0.0), max_new_tokens=0,
                                    prompt_logprobs=score.alternatives)
        return Prepared(request, messages=score.messages, scoring=Scoring(target=target, text=score.text is not None))

    async def tokens(self, messages: list[dict[str, Any]] | None, prompt: str | None, add_generation_prompt: bool,
                     continue_final: bool, kwargs: dict[str, Any]) -> list[int]:  # fmt: skip
        raise RequestError("unsupported", "prompt", "this server's model is upstream (--engine-url); tokenize there")

    def _images(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat as the upstream takes it: its image parts passed on where the upstream reads images (its probe),
        as data: URLs only (webchat fetches nothing, and has no upstream fetch for it); refused by name otherwise."""
        found = images_in(messages)
        if not found:
            return messages
        caps = self.caps
        if caps.images != "accepted":
            raise RequestError("unsupported", found[0][0], f"{found[0][0]} is an image: the upstream engine at "
                               f"{caps.url} ({caps.kind}) does not take images (its probe was refused one; serve a "
                               "vision model there, e.g. llama-server --mmproj)")
        for name, part in found:
            url = str(part.get("url", ""))
            if not url.lower().startswith("data:"):
                raise RequestError("image", name, f"{name} must be a data: URL (data:image/png;base64,...); webchat "
                                   f"passes no other on, got one starting {url[:24]!r}")
        return openai_form(messages)

    def _takes(self, fields: dict[str, Any]) -> None:
        """What the upstream was found not to take (its capability probe) is refused before anything is sent."""
        caps = self.caps
        fmt = fields.get("response_format") or {}
        wants = "json_schema" if fmt.get("type") == "json_schema" or "structured_outputs" in fields else (
            "json_object" if fmt.get("type") == "json_object" else None)
        if wants is not None and (caps.response_format == "absent" or (wants == "json_schema"
                                                                          and caps.response_format == "json_object")):
            raise RequestError("unsupported", "response_format", f"the upstream engine at {caps.url} does not take a "
                               f"{wants} reply format (its probe found {caps.response_format!r})")
        if "tools" in fields and caps.tools == "absent":
            raise RequestError("unsupported", "tools", f"the upstream engine at {caps.url} does not take tools (its "
                               "probe refused them)")


def _settings(settings: Settings) -> SamplingSettings:
    """The settings with any token id allowed (the upstream checks ids against its own vocabulary)."""
    try:
        return settings(2**31)
    except SettingsError as exc:
        raise RequestError("settings", f"settings.{exc.field}", f"settings.{exc}") from None
