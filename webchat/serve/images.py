"""Images on the request path (issue 61): a Turn's image parts decoded and planned off the event loop, the chat
template rendered with each image's marker and that marker written out as the projector's slots, and each image's
slots, key and encoder handed to the engine (webchat.engine.images), which encodes it on the device thread when the
prefill reaches it (docs/vision.md).

    vision = Vision(projector, slot_id, max_tiles=4)
    pictures = await vision.prepare(messages, max_tiles)      # ImagePartError("messages.1.content.0", ...)
    pictures.messages                                         # for the template: {"type": "image"} parts
    ids = encode(pictures.messages, expand=pictures.expander(messages))   # the markers written out, whole text
    pictures.inputs(ids, kept_messages)                       # -> [ImageInput] for the GenerationRequest

An image part is a `data:` URL (PNG, JPEG, WebP, GIF's first frame, BMP): the server fetches nothing, so an http(s)
URL is refused by name. A user who types the marker (`<image>`) gets its text: only the template's own text is
expanded (webchat.text.tokenizer.encode_chat's `expand`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes

from webchat.engine.images import ImageInput
from webchat.grammar.compiler import NICE, lower_priority
from webchat.serve.parts import images_in
from webchat.vision.image import FORMATS, ImageError, decode_image
from webchat.vision.layout import Segment, Slots, expand

if TYPE_CHECKING:
    from webchat.text.tokenizer import Tokenizer
    from webchat.vision.projector import ImagePlan, Projector

DEFAULT_MAX_TILES = 4  # a square photo: 2 x 2 tiles + the overview, 5 tiles, ~6-10 s to encode on 2 cores (SmolVLM)
MAX_TILES = 36  # what a request may ask for (SmolVLM's 6 x 6 tile tokens)
MAX_IMAGES = 16  # images in one request's chat, its history included (each decoded and planned)
DECODE_THREADS = 2  # images decoded and planned at once, server-wide (Pillow, at nice +10 below the device thread)
# a frame's and a body's size limit where a model reads images (1 MiB otherwise): a 2048 x 512 photo as PNG is ~1-3
# MiB, 4/3 of that in base64; 16 MiB takes a few photos a message. Each message is parsed whole, so this bounds what
# one connection's frame holds in memory (the websocket's uvicorn limit is 4x it)
IMAGE_MESSAGE_BYTES = 16 << 20
IMAGE_KEY = "webchat_image"  # a template message's image part: {"type": "image", IMAGE_KEY: its index}
_DECODE = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="webchat-image", initializer=lower_priority,
                             initargs=(NICE,))


class ImagePartError(ValueError):
    """An image part that cannot be read: `field` names it on the wire (messages.1.content.0), the message says what
    is wrong (the request path words it as RequestError("image", field, message))."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


@dataclass
class Vision:
    """A vision model's side of the request path: its projector, the text model's slot token id, the tile default."""

    projector: Projector
    slot_id: int
    max_tiles: int = DEFAULT_MAX_TILES

    def wire(self) -> dict[str, Any]:
        """What `hello.vision` says: the projector, its tiles and their tokens, the limits a request has."""
        p = self.projector
        return {"projector": p.kind, "image_size": p.image_size, "tokens_per_tile": p.tokens_per_tile,
                "max_tiles": self.max_tiles, "max_images": MAX_IMAGES, "formats": [f.lower() for f in FORMATS]}

    async def prepare(self, messages: list[dict[str, Any]], max_tiles: int | None = None) -> Pictures:
        """Every image part decoded and planned on the decode threads (the same URL once); the messages as the
        template reads them. ImagePartError naming the part and what is wrong with it."""
        tiles = self.max_tiles if max_tiles is None else max_tiles
        if not 1 <= tiles <= MAX_TILES:
            raise ImagePartError("image_max_tiles", f"image_max_tiles must be in [1, {MAX_TILES}], got {tiles}")
        found = images_in(messages)
        if len(found) > MAX_IMAGES:
            raise ImagePartError(found[MAX_IMAGES][0], f"the chat holds {len(found)} images; at most "
                               f"{MAX_IMAGES} a request are read (leave older images out of the history)")
        plans: list[ImagePlan] = []
        index: dict[tuple[str, int], int] = {}  # (url, tiles) -> its plan: an image sent twice is read once
        loop = asyncio.get_running_loop()
        for name, part in found:
            url = part.get("url")
            if not isinstance(url, str):
                raise ImagePartError(name, f"{name} has no URL; expected a data: URL")
            key = (url, 1 if part.get("detail") == "low" else tiles)  # OpenAI's low detail: one tile
            if key not in index:
                plan = await loop.run_in_executor(_DECODE, functools.partial(self._plan, url, name, key[1]))
                index[key] = len(plans)
                plans.append(plan)
        return Pictures(_template_messages(messages, index, tiles), plans, self)

    def _plan(self, url: str, name: str, max_tiles: int) -> ImagePlan:
        """On a decode thread: the URL's bytes (base64 decoded here, off the event loop), the image, its plan."""
        data = image_bytes(url, name)
        try:
            return self.projector.plan(decode_image(data), max_tiles=max_tiles)
        except ImageError as exc:
            raise ImagePartError(name, f"{name}: {exc}") from None


@dataclass
class Pictures:
    """A request's images, planned: the messages for the template and one plan per distinct image."""

    messages: list[dict[str, Any]]
    plans: list[ImagePlan]
    vision: Vision

    def expander(self, messages: list[dict[str, Any]]) -> Expander:
        """Writes out, in order, the markers of the images `messages` (some of self.messages) hold."""
        return Expander(self.vision.projector.kind, self.vision.projector.marker,
                        [self.plans[k].layout for k in order(messages)])

    def inputs(self, ids: list[int], messages: list[dict[str, Any]]) -> list[ImageInput]:
        """Each image of `messages` (the ones the prompt kept) with its runs of slots in `ids`, in order; a ValueError
        when the slot tokens there are not the images' (the template wrote the markers elsewhere)."""
        slots = [i for i, t in enumerate(ids) if t == self.vision.slot_id]
        kept = [self.plans[k] for k in order(messages)]
        want = sum(p.n_tokens for p in kept)
        if len(slots) != want:
            raise ValueError(f"the prompt holds {len(slots)} image slot tokens; its {len(kept)} images need {want}")
        out, at = [], 0
        projector = self.vision.projector
        for plan in kept:
            spans = []
            for seg in plan.layout:
                if isinstance(seg, Slots):
                    run = slots[at : at + seg.count]
                    if run[-1] - run[0] != seg.count - 1:
                        raise ValueError(f"an image's {seg.count} slots are not contiguous in the prompt")
                    spans.append((run[0], seg.count))
                    at += seg.count
            out.append(ImageInput(plan.key, tuple(spans), functools.partial(projector.encode, plan),
                                  bidirectional=projector.kind == "gemma3"))
        return out


class Expander:
    """The template's text with each image marker replaced by the next image's layout; `check` after the render."""

    def __init__(self, kind: str, marker: str, layouts: list[tuple[Segment, ...]]) -> None:
        self.kind, self.marker, self.layouts, self.used = kind, marker, layouts, 0

    def __call__(self, text: str) -> str:
        n = text.count(self.marker)
        if not n:
            return text
        if self.used + n > len(self.layouts):
            raise ValueError(f"the chat template wrote more image markers {self.marker!r} than the chat's "
                             f"{len(self.layouts)} images")
        out = expand(text, self.kind, self.layouts[self.used : self.used + n], self.marker)
        self.used += n
        return out

    def check(self) -> None:
        if self.used != len(self.layouts):
            raise ValueError(f"the chat template wrote {self.used} image markers {self.marker!r} for the chat's "
                             f"{len(self.layouts)} images (a template that shows no image parts cannot take them)")


def load_vision(path: Path, text_dim: int, tokenizer: Tokenizer, precision: str = "exact",
                max_tiles: int = DEFAULT_MAX_TILES) -> Vision:
    """The projector at `path` for a text model of `text_dim` wide embeddings and its tokenizer; ValueError naming the
    file and what does not fit (a projector type other than idefics3 and gemma3 is refused by name as it is read)."""
    from webchat.vision.projector import load_projector

    if not 1 <= max_tiles <= MAX_TILES:
        raise ValueError(f"--image-max-tiles must be in [1, {MAX_TILES}], got {max_tiles}")
    projector = load_projector(path, precision)
    if projector.text_dim != text_dim:
        raise ValueError(f"{Path(path).name} projects images to rows {projector.text_dim} wide; the model's embeddings "
                         f"are {text_dim} wide: it is another model's projector")
    missing = [t for t in (projector.slot_token, projector.marker) if tokenizer.token_id(t) is None]
    if missing:
        raise ValueError(f"{Path(path).name} is a {projector.kind} projector; the model's vocabulary has no token "
                         f"{missing[0]!r}: it is another model's projector")
    slot = tokenizer.token_id(projector.slot_token)
    assert slot is not None
    return Vision(projector, slot, max_tiles)


def image_bytes(url: str, name: str) -> bytes:
    """The bytes of a `data:` URL (base64 or percent-encoded); ImagePartError naming the part otherwise."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise ImagePartError(name, f"{name} is an {scheme} URL; the server fetches nothing: send the image as "
                           "a data: URL (data:image/png;base64,...)")
    if scheme != "data" or "," not in url:
        raise ImagePartError(name, f"{name} must be a data: URL (data:image/png;base64,...), got one starting "
                           f"{url[:24]!r}")
    head, payload = url[5:].split(",", 1)
    kind = head.split(";")[0].strip().lower()
    if kind and not kind.startswith("image/"):
        raise ImagePartError(name, f"{name} is a data: URL of {kind!r}; expected an image (image/png, "
                           "image/jpeg, image/webp, image/gif)")
    if head.lower().endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImagePartError(name, f"{name}'s base64 data does not decode: {exc}") from None
    return unquote_to_bytes(payload)


def order(messages: list[dict[str, Any]]) -> list[int]:
    """The plan index of each image part in template messages, in order."""
    return [p[IMAGE_KEY] for m in messages if isinstance(m.get("content"), list) for p in m["content"]
            if isinstance(p, dict) and IMAGE_KEY in p]


def _template_messages(messages: list[dict[str, Any]], index: dict[tuple[str, int], int],
                       tiles: int) -> list[dict[str, Any]]:  # fmt: skip
    """The messages with each image part as the template reads one ({"type": "image"}) and its plan's index."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [{"type": "image", IMAGE_KEY: index[p["url"], 1 if p.get("detail") == "low" else tiles]}
                       if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
            m = {**m, "content": content}
        out.append(m)
    return out
