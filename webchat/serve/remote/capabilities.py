"""What the upstream can give the heatmap, probed at start and again after it was lost (docs/scale-out.md).

    GET /v1/models                    → the models it serves, the context (vLLM max_model_len, webchat context_length)
    GET /api/info | /version | /props → which engine it is (webchat, vLLM, llama.cpp; else "openai-compatible")
    POST chat, max_tokens 1, logprobs → the largest top_logprobs it accepts (20, 10, 5, 1), bytes, ids per entry
    POST chat + return_token_ids      → token ids on the choice (vLLM)
    POST chat + continue_final_message, add_generation_prompt false → continues a final assistant message
    POST /tokenize (vLLM, webchat) | /apply-template (llama.cpp) → a chat's prompt as ids | text, so a branch's
                                      token ids can follow it in a /v1/completions prompt (token_prompt)
    POST chat + prompt_logprobs 1     → the prompt scored (vLLM, webchat): the page's `score` goes upstream
    POST chat + response_format json_schema | json_object, + tools → what structured output passes through
Each field the upstream does not give is a named state (`"absent"`, `"unknown"`), never a zero.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from webchat.serve.remote.client import Upstream, UpstreamError

log = logging.getLogger("webchat.serve.remote")

TOP_LOGPROBS_TRIES = (20, 10, 5, 1)
MAX_MODELS = 256  # of the upstream's model list, kept and shown (hello.engine.models, /api/info)
PROBE = [{"role": "user", "content": "Hi"}]


@dataclass
class Capabilities:
    url: str
    state: str = "unknown"  # "ready" | "unreachable" | "unknown" (not probed yet)
    error: str | None = None  # why it is unreachable
    kind: str = "unknown"  # webchat | vllm | llama.cpp | sglang | openai-compatible
    models: list[str] = field(default_factory=list)
    model: str | None = None
    context_length: int | None = None
    max_top_logprobs: int = 0  # 0: no alternatives (the upstream refused every top_logprobs tried)
    probabilities: str = "unknown"  # raw | post_sampling | absent | unknown
    bytes: str = "unknown"  # returned | absent | unknown
    token_ids: str = "unknown"  # per_entry (llama.cpp) | return_token_ids (vLLM) | absent | unknown
    continue_final: str = "unknown"  # continue_final_message | final_assistant_message | unknown
    # how a branch's token ids reach the upstream: tokenize (the chat's prompt ids from /tokenize, then the ids) |
    # apply_template (the chat's prompt text from /apply-template, then the ids, one mixed prompt) | absent (as text)
    token_prompt: str = "unknown"
    prompt_logprobs: str = "unknown"  # returned (vLLM, webchat: the page can score texts) | absent | unknown
    # structured output passed through (webchat.serve.tools.upstream_fields): json_schema (it takes a JSON
    # schema's response_format) | json_object (only JSON mode) | absent; tools: accepted | absent
    response_format: str = "unknown"
    tools: str = "unknown"
    images: str = "unknown"  # accepted (a chat's image parts go upstream: a vision model) | absent (refused here)
    # the served model's thinking as hello.thinking says it ({start, end, switch}): a webchat's own, a llama-server's
    # from its template (/props chat_template); None where the upstream does not say
    thinking: dict[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        """What `hello.engine` and /api/info show (the key never is here: it is not part of this)."""
        return asdict(self)


def _first_entry(resp: Any) -> dict[str, Any] | None:
    try:
        entry = resp["choices"][0]["logprobs"]["content"][0]
    except (KeyError, IndexError, TypeError):
        return None
    return entry if isinstance(entry, dict) else None


KINDS = (("/api/info", ("speculative",), "webchat"), ("/version", ("version",), "vllm"),
         ("/props", ("default_generation_settings", "build_info"), "llama.cpp"),
         ("/get_server_info", ("tp_size", "model_path"), "sglang"))


async def _kind(up: Upstream) -> str:
    for path, keys, name in KINDS:
        try:
            body = await up.get_json(path)
        except UpstreamError:
            continue
        if isinstance(body, dict) and any(k in body for k in keys):
            return name
    return "openai-compatible"


async def detect(up: Upstream, want_model: str | None) -> Capabilities:
    """Probe the upstream; an unreachable one gives state "unreachable" with the error, not an exception."""
    caps = Capabilities(url=up.url)
    try:
        listing = await up.get_json("/v1/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)] if isinstance(
            data, list) else []
        ids = [c["id"] for c in cards]
        if want_model is not None and want_model not in ids:
            raise UpstreamError(f"the upstream engine at {up.url} does not serve model {want_model!r}; it serves "
                                f"{_listed(ids)}")
        if not ids:
            raise UpstreamError(f"the upstream engine at {up.url} lists no models at /v1/models")
        caps.model = want_model or ids[0]
        card = cards[ids.index(caps.model)]
        caps.models = ids[:MAX_MODELS]
        if len(ids) > MAX_MODELS:
            log.warning("the upstream engine at %s lists %d models; the first %d are kept", up.url, len(ids),
                        MAX_MODELS)
            if caps.model not in caps.models:
                caps.models[-1] = caps.model
        for key in ("max_model_len", "context_length"):
            if _length(card.get(key)):
                caps.context_length = card[key]
                break
        meta = card.get("meta")
        if caps.context_length is None and isinstance(meta, dict) and _length(meta.get("n_ctx_train")):
            caps.context_length = meta["n_ctx_train"]  # llama.cpp: the trained context (its --ctx-size may be less)
        caps.kind = await _kind(up)
        base = {"model": caps.model, "messages": PROBE, "max_tokens": 1, "temperature": 0, "stream": False}
        entry = None
        for k in TOP_LOGPROBS_TRIES:
            try:
                entry = _first_entry(await up.post_json("/v1/chat/completions",
                                                        {**base, "logprobs": True, "top_logprobs": k}))
            except UpstreamError as exc:
                if exc.status is None or exc.status >= 500:
                    raise
                continue
            caps.max_top_logprobs = k
            break
        if entry is None:
            caps.probabilities = caps.bytes = "absent"
        else:
            caps.probabilities = "post_sampling" if "prob" in entry and "logprob" not in entry else (
                "raw" if "logprob" in entry else "absent")
            caps.bytes = "returned" if isinstance(entry.get("bytes"), list) else "absent"
            if isinstance(entry.get("id"), int):
                caps.token_ids = "per_entry"
        if caps.token_ids == "unknown":
            caps.token_ids = "absent"
            try:
                resp = await up.post_json("/v1/chat/completions", {**base, "return_token_ids": True})
                if isinstance(resp, dict) and isinstance((resp.get("choices") or [{}])[0].get("token_ids"), list):
                    caps.token_ids = "return_token_ids"
            except UpstreamError as exc:
                if exc.status is None:
                    raise
        continued = [*PROBE, {"role": "assistant", "content": "Hel"}]
        try:
            await up.post_json("/v1/chat/completions", {**base, "messages": continued,
                                                        "continue_final_message": True,
                                                        "add_generation_prompt": False})
            caps.continue_final = "continue_final_message"
        except UpstreamError as exc:
            if exc.status is None:
                raise
            # llama.cpp continues a final assistant message by itself (--prefill-assistant, on by default)
            caps.continue_final = "final_assistant_message"
        caps.token_prompt = await _token_prompt(up, caps) if caps.token_ids != "absent" else "absent"
        caps.prompt_logprobs = await _prompt_logprobs(up, base)
        caps.response_format, caps.tools = await _structured(up, base)
        caps.images = await _images(up, base)
        caps.thinking = await _thinking(up, caps.kind)
        caps.state = "ready"
    except UpstreamError as exc:
        caps.state, caps.error = "unreachable", str(exc)
    return caps


async def _prompt_logprobs(up: Upstream, base: dict[str, Any]) -> str:
    """Whether the upstream scores a prompt: vLLM's `prompt_logprobs` on the chat response (top level, as vLLM has
    it) or on its choice; a refusal or an answer without them is `absent`."""
    try:
        resp = await up.post_json("/v1/chat/completions", {**base, "prompt_logprobs": 1})
    except UpstreamError as exc:
        if exc.status is None:
            raise
        return "absent"
    choice = (resp.get("choices") or [{}])[0] if isinstance(resp, dict) else {}
    found = resp.get("prompt_logprobs") if isinstance(resp, dict) else None
    found = found if found is not None else choice.get("prompt_logprobs") if isinstance(choice, dict) else None
    return "returned" if isinstance(found, list) and len(found) > 1 else "absent"


PROBE_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "a probe",
                                               "parameters": {"type": "object", "properties": {}}}}


async def _structured(up: Upstream, base: dict[str, Any]) -> tuple[str, str]:
    """Whether the upstream takes a JSON schema's response_format (or only JSON mode), and tools: a request of one
    token with each, accepted (2xx) or refused (4xx). llama-server and vLLM take both; an engine that ignores a field
    it does not know is taken at its word (the reply then shows whether it was honoured)."""

    async def accepted(extra: dict[str, Any]) -> bool:
        try:
            await up.post_json("/v1/chat/completions", {**base, **extra})
            return True
        except UpstreamError as exc:
            if exc.status is None or exc.status >= 500:
                raise
            return exc.context_overflow  # taken, then the prompt (with the tools) did not fit a small context

    schema = {"type": "json_schema", "json_schema": {"name": "probe", "schema": PROBE_SCHEMA}}
    fmt = ("json_schema" if await accepted({"response_format": schema}) else
           "json_object" if await accepted({"response_format": {"type": "json_object"}}) else "absent")
    tools = "accepted" if await accepted({"tools": [PROBE_TOOL], "tool_choice": "auto"}) else "absent"
    return fmt, tools


# a 1 x 1 white PNG: what an upstream that reads images answers a token about, and any other refuses
PROBE_IMAGE = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4"
               "AAAAAElFTkSuQmCC")


async def _images(up: Upstream, base: dict[str, Any]) -> str:
    """Whether the upstream takes an image part (a vision model: llama-server with --mmproj, vLLM, a webchat with
    --mmproj): a one-token request about a 1 x 1 image, answered (accepted) or refused with any status (absent)."""
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PROBE_IMAGE}},
                                         {"type": "text", "text": "Hi"}]}
    try:
        await up.post_json("/v1/chat/completions", {**base, "messages": [image]})
    except UpstreamError as exc:
        if exc.status is None:
            raise
        return "absent"
    return "accepted"


def _length(value: Any) -> bool:
    """A context length: an integer from 1 to 2^31 (an upstream that says 10^100 says nothing)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 31


def _listed(ids: list[str], n: int = 20) -> str:
    return str(ids) if len(ids) <= n else f"{ids[:n]} and {len(ids) - n} more"


async def _token_prompt(up: Upstream, caps: Capabilities) -> str:
    """Whether the upstream can tell the chat's own prompt (as ids or as text) for a token-id completion."""
    try:
        resp = await up.post_json("/tokenize", {"model": caps.model, "messages": PROBE, "add_generation_prompt": True})
        if isinstance(resp, dict) and isinstance(resp.get("tokens"), list) and resp["tokens"]:
            return "tokenize"
    except UpstreamError as exc:
        if exc.status is None:
            raise
    try:
        resp = await up.post_json("/apply-template", {"messages": PROBE})
        if isinstance(resp, dict) and isinstance(resp.get("prompt"), str) and resp["prompt"]:
            return "apply_template"
    except UpstreamError as exc:
        if exc.status is None:
            raise
    return "absent"


async def _thinking(up: Upstream, kind: str) -> dict[str, Any] | None:
    """The model's thinking: a webchat's /api/info `thinking`; a llama-server's template (/props `chat_template`)
    taking `enable_thinking` means the `<think>` markers and the switch."""
    path = {"webchat": "/api/info", "llama.cpp": "/props"}.get(kind)
    if path is None:
        return None
    try:
        body = await up.get_json(path)
    except UpstreamError:
        return None
    if not isinstance(body, dict):
        return None
    if kind == "webchat":
        info = body.get("thinking")
        return info if isinstance(info, dict) else None
    template = body.get("chat_template")
    if isinstance(template, str) and "enable_thinking" in template:
        return {"start": "<think>", "end": "</think>", "switch": True}
    return None
