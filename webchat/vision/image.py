"""An uploaded image's bytes decoded to RGB pixels with Pillow, with every hostile case refused by name first.

What transformers' processor would see: the bytes are opened as `transformers.image_utils.load_image` opens a path,
URL or base64 string (Pillow, then `ImageOps.exif_transpose`: the EXIF orientation is applied), and the pixels made
RGB as the image processor's `convert_to_rgb` makes them (an image with an alpha channel, or a palette or grey image
with a transparent colour, is composited over white; everything else, CMYK included, goes through Pillow's
`convert("RGB")`). `load_image` alone would instead drop the alpha channel (`convert("RGB")`), which shows a
transparent PNG's hidden colours, black for most; we composite as the processor does for an image handed to it.

One departure, named: a 16-bit grey PNG (Pillow's "I;16") keeps its high byte, as llama.cpp's stb_image and browsers
show it; Pillow's `convert("RGB")`, which transformers calls, saturates every value above 255 to white. Pillow itself
reduces 16-bit colour PNGs to 8 bits by their high byte. An animated GIF or WebP gives its first frame, as Pillow opens
it.

Refused before any pixel is decoded: more bytes than `ImageLimits.max_bytes`, a format outside PNG, JPEG, WebP, GIF and
BMP (Pillow's other plugins are not offered the bytes), and a declared size over `max_pixels` (a 1 KB PNG declaring
50,000 x 50,000). Memory is then bounded by about 12 bytes a pixel (the decoded frame, its RGBA and RGB copies).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image as PILImage
from PIL import ImageOps, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MIB = 1 << 20


class ImageError(ValueError):
    """An image that cannot be used; `code` names the case (too_large, not_an_image, too_many_pixels, truncated,
    corrupt), the message says what was expected and what came."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 32 * MIB
    max_pixels: int = 40_000_000  # a 48 MP phone photo is refused; 12 MP and 24 MP pass
    max_side: int = 32768


LIMITS = ImageLimits()


@dataclass(frozen=True)
class Image:
    """Decoded RGB pixels (a loaded Pillow image, never changed after decoding) and their content hash."""

    pil: PILImage.Image
    sha256: str  # of the RGB bytes and the size: two files with the same pixels share it
    source_format: str

    @property
    def width(self) -> int:
        return self.pil.width

    @property
    def height(self) -> int:
        return self.pil.height


def decode_image(data: bytes, limits: ImageLimits = LIMITS) -> Image:
    """The RGB image in `data` (PNG, JPEG, WebP, GIF, BMP); ImageError naming the case otherwise."""
    if len(data) > limits.max_bytes:
        raise ImageError("too_large", f"the image is {len(data)} bytes; at most {limits.max_bytes} are accepted")
    im = _open(data, limits)
    fmt = str(im.format)
    try:
        im.load()
        im = ImageOps.exif_transpose(im)
        rgb = to_rgb(im)
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # Pillow's words for a broken stream
        words = str(exc) or type(exc).__name__
        code = "truncated" if "truncated" in words or isinstance(exc, EOFError) else "corrupt"
        raise ImageError(code, f"the {fmt} image could not be decoded: {words}") from None
    raw = rgb.tobytes()
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode() + raw).hexdigest()
    return Image(rgb, digest, fmt)


def _open(data: bytes, limits: ImageLimits) -> PILImage.Image:
    """Pillow's lazy open (the header only), its size checked against the limits."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            im = PILImage.open(io.BytesIO(data), formats=FORMATS)
    except (PILImage.DecompressionBombWarning, PILImage.DecompressionBombError) as exc:
        raise ImageError("too_many_pixels", f"the image declares more pixels than the {limits.max_pixels} accepted "
                                            f"(Pillow: {exc})") from None
    except UnidentifiedImageError:
        head = data[:8]
        raise ImageError("not_an_image", f"not an image in a format webchat reads ({', '.join(FORMATS)}); the data "
                                         f"starts with {head!r}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError("corrupt", f"the image header could not be read: {exc}") from None
    w, h = im.size
    if w < 1 or h < 1 or w > limits.max_side or h > limits.max_side or w * h > limits.max_pixels:
        raise ImageError("too_many_pixels", f"the {im.format} image declares {w} x {h} pixels; at most "
                                            f"{limits.max_pixels} pixels and {limits.max_side} a side are accepted")
    return im


def to_rgb(im: PILImage.Image) -> PILImage.Image:
    """RGB as transformers' convert_to_rgb makes it (alpha over white), 16-bit grey by its high byte."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        high = np.clip(np.asarray(im, dtype=np.int64) >> 8, 0, 255).astype(np.uint8)
        return PILImage.fromarray(high).convert("RGB")
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")
