"""Test helper: deterministic pictures (gradients, stripes, noise) and their webchat Image."""

from __future__ import annotations

import hashlib
import struct
import zlib

import numpy as np
from PIL import Image as PILImage

from webchat.vision.image import Image


def picture(width: int, height: int, seed: int = 0) -> PILImage.Image:
    """Gradients, stripes and noise: every resize filter's weights show in the result."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    r = (255 * x / max(width - 1, 1)).astype(np.int64)
    g = (255 * y / max(height - 1, 1)).astype(np.int64)
    b = ((x // 7 + y // 5) % 2) * 200
    noise = rng.integers(0, 40, size=(height, width, 3))
    rgb = np.clip(np.stack([r, g, b], axis=-1) + noise, 0, 255).astype(np.uint8)
    return PILImage.fromarray(rgb)


def as_image(pil: PILImage.Image) -> Image:
    """The picture as decode_image would give it (its pixels hashed), without an encoding round trip."""
    digest = hashlib.sha256(f"{pil.width}x{pil.height}:".encode() + pil.tobytes()).hexdigest()
    return Image(pil, digest, "PNG")


def png_declaring(width: int, height: int) -> bytes:
    """A few hundred bytes: a PNG header that declares width x height, then one empty IDAT (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(
        b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
