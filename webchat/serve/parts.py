"""A message's parts, the same on both wires (OpenAI's content parts): text, and an image as a `data:` URL; a tool
call and a tool result are a message's own fields (`tool_calls` on an assistant message, `tool_call_id` on a `tool`
message). The one place both wires read them.

    content: "text" | [{"type": "text", "text": ...}, {"type": "image_url", "image_url": {"url": "data:image/png;..."}}]
    neutral(content) -> "text" | [{"type": "text", "text": ...}, {"type": "image", "url": ..., "detail"?: "low"}]
    text_of(content) -> its text parts joined by newlines

The request path (webchat.serve.requests) takes the neutral form: a model that reads text refuses an image part by
name; a vision model's Preparer decodes it (webchat.vision).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

MAX_PARTS = 64  # parts in one message
MAX_URL_CHARS = 24 << 20  # a data URL's characters (the body limit bounds it further)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: Annotated[str, Field(min_length=1, max_length=MAX_URL_CHARS)]
    detail: Literal["auto", "low", "high"] | None = None  # "low": one tile (webchat.serve.images); else the request's


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]
Parts = Annotated[list[Part], Field(max_length=MAX_PARTS)]
Neutral = str | list[dict[str, Any]]
PARTS = "(parts)"  # the union tag of content given as parts; left out of error paths (`messages.0.content.64`)


def _content_kind(v: Any) -> str | None:
    return "text" if isinstance(v, str) else PARTS if isinstance(v, list) else None


Content = Annotated[  # a message's content on both wires: text, or parts (one error, naming the part, when wrong)
    Annotated[str, Tag("text")] | Annotated[Parts, Tag(PARTS)],
    Discriminator(_content_kind, custom_error_type="expected",
                  custom_error_message="expected a string or a list of content parts (text, image_url)"),
]


def neutral(content: str | list[TextPart | ImagePart] | None) -> Neutral:
    """The content as the request path takes it: text as it is; parts as {"type": "text"} and {"type": "image"}."""
    if content is None or isinstance(content, str):
        return content or ""
    if all(isinstance(p, TextPart) for p in content):
        return "\n".join(p.text for p in content if isinstance(p, TextPart))
    return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else _image(p) for p in content]


def _image(part: ImagePart) -> dict[str, Any]:
    """An image part in the neutral form: its URL, and OpenAI's `detail` where given ("low": one tile)."""
    out = {"type": "image", "url": part.image_url.url}
    return out if part.image_url.detail is None else {**out, "detail": part.image_url.detail}


def text_of(content: Neutral | list[TextPart | ImagePart] | None) -> str:
    """A content's text: its text parts joined by newlines (images leave no text)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = [p.text if isinstance(p, TextPart) else p.get("text", "") if isinstance(p, dict) and
             p.get("type") == "text" else None for p in content]
    return "\n".join(t for t in texts if t is not None)


def openai_form(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Neutral messages as an OpenAI-compatible upstream takes them: image parts as `image_url` parts again."""
    def part(p: Any) -> Any:
        if not (isinstance(p, dict) and p.get("type") == "image"):
            return p
        url = {"url": p.get("url")} | ({"detail": p["detail"]} if "detail" in p else {})
        return {"type": "image_url", "image_url": url}

    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in messages]


def images_in(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(field, part) of every image part in neutral messages: `messages.3.content.1`."""
    return [(f"messages.{i}.content.{j}", part) for i, m in enumerate(messages)
            if isinstance(m.get("content"), list) for j, part in enumerate(m["content"])
            if isinstance(part, dict) and part.get("type") == "image"]


def check_tool_fields(role: str, tool_calls: list[Any] | None, tool_call_id: str | None) -> None:
    """Only an assistant message carries tool_calls; a tool message, and only it, names the call it answers."""
    if tool_calls is not None and role != "assistant":
        raise PydanticCustomError("tool_calls", "only assistant messages carry tool_calls, got a {role} message",
                                  {"role": repr(role)})
    if (role == "tool") != (tool_call_id is not None):
        raise PydanticCustomError("tool_call_id", "a tool message needs tool_call_id (and only a tool message has "
                                  "one), got role {role}", {"role": repr(role)})
