"""An image made into the projector's input tiles exactly as transformers' image processors make them (the Pillow
backends, `Idefics3ImageProcessorPil` and `Gemma3ImageProcessorPil`), resizes done by Pillow on the 8-bit pixels.

idefics3 (SmolVLM): the longest edge resized to L (`clip.vision.preproc_image_size`, 2048; Lanczos, the short edge
`int(L / aspect)` rounded up to even), then both edges up to multiples of the tile S (512) (Lanczos again); an image
larger than one tile is cut row-major into S x S tiles and the whole image, resized to S x S, follows last as the
global image. One that fits a tile is sent alone, with no grid: the processor's choice, taken here. llama.cpp's mtmd
sends a 1x1 grid plus the overview in that case (two encodings of the same pixels, 128 tokens where the model was
trained on 64); the reference is transformers, on which SmolVLM was trained. With L = 2048 every image spans several
tiles; one fits a tile when `max_tiles` brings L down to S.
`max_tiles` bounds the grid: L is the largest of L, then (k S for k = L // S - 1 ... 1) whose grid has at most
`max_tiles` tiles, which is what the processor does when given `size={"longest_edge": k S}`.

gemma3: one 896 x 896 image (bilinear); pan and scan (off in Gemma 3's processor config) is not done.
Both: x = float32(float64(u8) / 255); y = (x - mean) / std in float32, as transformers' rescale and normalize.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image as PILImage

from webchat.vision.projector_file import ProjectorConfig

MAX_IMAGE_SIZE = 4096  # transformers' idefics3 MAX_IMAGE_SIZE: no resized edge goes past it
RESAMPLE = {"idefics3": PILImage.Resampling.LANCZOS, "gemma3": PILImage.Resampling.BILINEAR}
DEFAULT_MAX_TILES = 36


@dataclass(frozen=True)
class Tiles:
    """A preprocessed image: its tiles (N, 3, S, S) float32 and the grid (rows, cols); (0, 0) for one image alone."""

    pixels: torch.Tensor
    rows: int
    cols: int
    longest_edge: int


def preprocess(im: PILImage.Image, c: ProjectorConfig, max_tiles: int = DEFAULT_MAX_TILES) -> Tiles:
    """The tiles of RGB image `im` for projector `c`."""
    if im.mode != "RGB":
        raise ValueError(f"expected an RGB image (webchat.vision.decode_image makes one); got mode {im.mode!r}")
    if max_tiles < 1:
        raise ValueError(f"max_tiles must be at least 1; got {max_tiles}")
    if c.kind == "gemma3":
        one = im.resize((c.image_size, c.image_size), RESAMPLE["gemma3"])
        return Tiles(normalize([one], c), 0, 0, c.image_size)
    edge = pick_longest_edge(im.width, im.height, c, max_tiles)
    h, w = resized_size(im.height, im.width, edge)
    im = im.resize((w, h), RESAMPLE["idefics3"])
    s = c.image_size
    h, w = refined_size(h, w, s)
    im = im.resize((w, h), RESAMPLE["idefics3"])
    if h <= s and w <= s:
        return Tiles(normalize([im], c), 0, 0, edge)
    rows, cols = h // s, w // s
    tiles = [im.crop((col * s, row * s, col * s + s, row * s + s)) for row in range(rows) for col in range(cols)]
    tiles.append(im.resize((s, s), RESAMPLE["idefics3"]))
    return Tiles(normalize(tiles, c), rows, cols, edge)


def resized_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """(h, w) with the longest edge at `edge`, the other `int(edge / aspect)` made even (transformers'
    _resize_output_size_rescale_to_max_len, then _resize_output_size_scale_below_upper_bound at 4096)."""
    aspect = width / height
    if width >= height:
        width, height = edge, int(edge / aspect)
        height += height % 2
    else:
        height, width = edge, int(edge * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def refined_size(height: int, width: int, s: int) -> tuple[int, int]:
    """Both edges up to multiples of the tile, the short one through the aspect ratio as transformers'
    resize_for_vision_encoder takes it."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / s) * s
        height = math.ceil(int(width / aspect) / s) * s
    else:
        height = math.ceil(height / s) * s
        width = math.ceil(int(height * aspect) / s) * s
    return height, width


def grid(width: int, height: int, edge: int, s: int) -> tuple[int, int]:
    """(rows, cols) of tiles an image of width x height gets at longest edge `edge`; (0, 0) when it fits one."""
    h, w = refined_size(*resized_size(height, width, edge), s)
    return (0, 0) if h <= s and w <= s else (h // s, w // s)


def pick_longest_edge(width: int, height: int, c: ProjectorConfig, max_tiles: int) -> int:
    """The file's longest edge, or the largest smaller multiple of the tile whose grid fits `max_tiles`."""
    s = c.image_size
    for edge in [c.longest_edge, *range((c.longest_edge - 1) // s * s, 0, -s)]:
        rows, cols = grid(width, height, edge, s)
        if rows * cols <= max_tiles:
            return int(edge)
    return s


def normalize(images: list[PILImage.Image], c: ProjectorConfig) -> torch.Tensor:
    """(N, 3, S, S) float32: (float32(u8 * (1/255) in float64) - mean) / std, channels first."""
    u8 = np.stack([np.asarray(im, dtype=np.uint8) for im in images])  # (N, S, S, 3)
    x = (u8.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean, std = np.array(c.image_mean, dtype=np.float32), np.array(c.image_std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(((x - mean) / std).transpose(0, 3, 1, 2)))
