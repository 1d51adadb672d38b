"""decode_image on hostile and unusual images: each refused by a named code before its pixels are decoded, or decoded
as transformers' reference decodes it (Pillow + exif_transpose, then the processor's convert_to_rgb)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image as PILImage
from PIL import ImageOps

from webchat.vision.image import ImageError, ImageLimits, decode_image


def encode(im: PILImage.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def reference(data: bytes) -> np.ndarray:
    """What transformers makes of these bytes: load_image's exif_transpose, the processor's convert_to_rgb."""
    pytest.importorskip("transformers")
    from transformers.image_transforms import convert_to_rgb

    im = ImageOps.exif_transpose(PILImage.open(io.BytesIO(data)))
    return np.asarray(convert_to_rgb(im, return_numpy=True))


def noise(w: int, h: int, mode: str = "RGB", seed: int = 0) -> PILImage.Image:
    bands = len(mode) if mode in ("RGB", "RGBA", "CMYK", "LA") else 1
    arr = np.random.default_rng(seed).integers(0, 256, size=(h, w, bands), dtype=np.uint8)
    return PILImage.fromarray(arr[..., 0] if bands == 1 else arr, mode=None).convert(mode)


def png_declaring(width: int, height: int) -> bytes:
    """A ~100-byte PNG whose header declares width x height 8-bit RGB pixels (a decompression bomb's shape)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_plain_rgb_is_the_reference_and_hashes_its_pixels() -> None:
    im = noise(37, 23)
    png, bmp = decode_image(encode(im, "PNG")), decode_image(encode(im, "BMP"))
    assert np.array_equal(np.asarray(png.pil), reference(encode(im, "PNG")))
    assert png.sha256 == bmp.sha256 and (png.width, png.height) == (37, 23)
    assert decode_image(encode(noise(37, 23, seed=1), "PNG")).sha256 != png.sha256


@pytest.mark.parametrize("data", [b"hello, world", b"", b"\x89PNG\r\n\x1a\n", b"GIF89a"])
def test_not_an_image(data: bytes) -> None:
    with pytest.raises(ImageError) as exc:
        decode_image(data)
    assert exc.value.code in ("not_an_image", "corrupt", "truncated")


def test_a_format_outside_the_list_is_not_offered_to_pillow() -> None:
    with pytest.raises(ImageError, match="PNG, JPEG, WEBP, GIF, BMP") as exc:
        decode_image(encode(noise(8, 8), "TIFF"))
    assert exc.value.code == "not_an_image"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_truncated_file_is_named(fmt: str) -> None:
    data = encode(noise(64, 64), fmt)
    with pytest.raises(ImageError) as exc:
        decode_image(data[: len(data) // 2])
    assert exc.value.code in ("truncated", "corrupt")
    assert fmt in str(exc.value)


def test_a_decompression_bomb_is_refused_before_its_pixels(monkeypatch: pytest.MonkeyPatch) -> None:
    data = png_declaring(50_000, 50_000)
    assert len(data) < 1024

    def no_decoding(self: PILImage.Image) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(PILImage.Image, "load", no_decoding)
    with pytest.raises(ImageError, match="more pixels than the 40000000 accepted") as exc:
        decode_image(data)
    assert exc.value.code == "too_many_pixels"


def test_a_size_under_pillows_bomb_limit_but_over_ours_is_refused() -> None:
    with pytest.raises(ImageError, match="9000 x 5000") as exc:
        decode_image(png_declaring(9000, 5000))
    assert exc.value.code == "too_many_pixels"
    with pytest.raises(ImageError, match=r"\d+ bytes; at most 100 are accepted") as exc:
        decode_image(encode(noise(16, 16), "PNG"), ImageLimits(max_bytes=100))
    assert exc.value.code == "too_large"


def test_an_animated_gif_gives_its_first_frame() -> None:
    frames = [PILImage.new("RGB", (20, 10), c) for c in ((200, 10, 10), (10, 200, 10), (10, 10, 200))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    got = np.asarray(decode_image(data).pil)
    assert np.array_equal(got, reference(data))
    assert tuple(got[5, 5]) == (200, 10, 10)


def test_cmyk_goes_through_pillows_conversion() -> None:
    data = encode(noise(32, 16, "CMYK"), "JPEG", quality=95)
    assert np.array_equal(np.asarray(decode_image(data).pil), reference(data))


def test_alpha_and_a_transparent_palette_colour_are_composited_over_white() -> None:
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 255, 128  # half-transparent red
    rgba[0, 0] = (0, 0, 0, 0)  # fully transparent black: white once composited
    data = encode(PILImage.fromarray(rgba), "PNG")
    got = np.asarray(decode_image(data).pil)
    assert np.array_equal(got, reference(data))
    assert tuple(got[0, 0]) == (255, 255, 255) and tuple(got[1, 1]) == (255, 127, 127)
    pal = PILImage.new("P", (4, 4), 0)
    pal.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    pal.putpixel((1, 1), 1)
    data = encode(pal, "PNG", transparency=0)
    got = np.asarray(decode_image(data).pil)
    assert np.array_equal(got, reference(data))
    assert tuple(got[0, 0]) == (255, 255, 255) and tuple(got[1, 1]) == (0, 255, 0)


def test_16_bit_grey_keeps_its_high_byte() -> None:
    values = (np.arange(64 * 32).reshape(32, 64) * 31).astype(np.uint16)
    data = encode(PILImage.fromarray(values), "PNG")
    got = np.asarray(decode_image(data).pil)
    assert got.shape == (32, 64, 3)
    assert np.array_equal(got[..., 0], (values >> 8).astype(np.uint8))
    assert np.array_equal(got[..., 0], got[..., 2])


def test_the_exif_orientation_is_applied_as_load_image_applies_it() -> None:
    im = noise(30, 20)
    exif = PILImage.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(im, "JPEG", exif=exif.tobytes(), quality=95)
    got = decode_image(data)
    assert (got.width, got.height) == (20, 30)
    assert np.array_equal(np.asarray(got.pil), reference(data))
    pytest.importorskip("transformers")
    from transformers.image_utils import load_image

    path_like = io.BytesIO(data)
    assert np.array_equal(np.asarray(got.pil), np.asarray(load_image(PILImage.open(path_like))))
