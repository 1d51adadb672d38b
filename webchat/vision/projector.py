"""The vision API: a projector file loaded once, an image planned (tiles, grid, prompt layout, content key) and
encoded to embedding rows for the text model's image slots, cached by content.

    projector = load_projector(path)                # kind, image_size, tokens_per_tile, text_dim, marker, slot_token
    plan = projector.plan(decode_image(data), max_tiles=16)
    rows = projector.encode(plan)                   # (plan.n_tokens, text_dim) float32, one row per slot, in order
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from webchat.vision.cache import DEFAULT_BYTES, EmbeddingCache
from webchat.vision.encoder import encode_tiles
from webchat.vision.image import Image
from webchat.vision.layout import MARKER, SLOT, Segment, Slots, layout
from webchat.vision.native import PRECISIONS, build_tower
from webchat.vision.preprocess import DEFAULT_MAX_TILES, preprocess
from webchat.vision.projector_file import ProjectorConfig, ProjectorFile, read_projector
from webchat.vision.weights import float_weights

if TYPE_CHECKING:
    from webchat.kernels.cpu.build import VisionHandle


BATCH_TILES = 8  # tiles a forward: SmolVLM's 17 (4 x 4 + 1) in three, each large enough for the GEMMs' full rate


@dataclass(frozen=True)
class ImagePlan:
    """One image made ready: its tiles, grid, prompt layout and the key its embeddings are cached under."""

    tiles: torch.Tensor  # (N, 3, S, S) float32
    rows: int  # tile grid; (0, 0) when the image goes alone (gemma3 always, idefics3 when it fits one tile)
    cols: int
    layout: tuple[Segment, ...]
    key: str  # the pixels' sha256 and every setting the tiles depend on

    @property
    def n_tokens(self) -> int:
        return sum(s.count for s in self.layout if isinstance(s, Slots))


class Projector:
    """A loaded projector: plans images and encodes them (C++ where the kernels load, else PyTorch)."""

    def __init__(self, pf: ProjectorFile, precision: str = "exact", backend: str = "auto",
                 cache_bytes: int = DEFAULT_BYTES) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
        if backend not in ("auto", "cpp", "torch"):
            raise ValueError(f"backend must be auto, cpp or torch; got {backend!r}")
        self.file, self.config, self.precision = pf, pf.config, precision
        self.cache = EmbeddingCache(cache_bytes)
        self._tower = None if backend == "torch" else _tower(pf, precision, required=backend == "cpp")
        if self._tower is None and precision == "int8":
            raise ValueError("the int8 precision needs the C++ kernels, which did not load")
        self._weights: dict[str, torch.Tensor] | None = None

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def image_size(self) -> int:
        return self.config.image_size

    @property
    def tokens_per_tile(self) -> int:
        return self.config.tokens_per_tile

    @property
    def text_dim(self) -> int:
        return self.config.text_dim

    @property
    def marker(self) -> str:
        """What the chat template writes where an image goes (each is replaced by a plan's layout)."""
        return MARKER[self.kind]

    @property
    def slot_token(self) -> str:
        """The token whose positions take the embedding rows."""
        return SLOT[self.kind]

    @property
    def backend(self) -> str:
        return "torch" if self._tower is None else "cpp"

    def plan(self, image: Image, max_tiles: int = DEFAULT_MAX_TILES) -> ImagePlan:
        """The tiles and layout of `image` with at most `max_tiles` tiles (besides idefics3's global image)."""
        tiles = preprocess(image.pil, self.config, max_tiles)
        segments = layout(self.kind, tiles.rows, tiles.cols, self.tokens_per_tile)
        key = f"{image.sha256}:{self.kind}:{self.image_size}:{tiles.longest_edge}"
        return ImagePlan(tiles.pixels, tiles.rows, tiles.cols, segments, key)

    def encode(self, plan: ImagePlan) -> torch.Tensor:
        """(plan.n_tokens, text_dim) float32, the slots' rows in layout order (idefics3: tiles row-major, global
        last); cached by the plan's key."""
        cached = self.cache.get(plan.key)
        if cached is not None:
            return cached
        rows = self.encode_tiles(plan.tiles)
        if rows.shape[0] != plan.n_tokens:
            raise RuntimeError(f"the encoder gave {rows.shape[0]} rows for a plan of {plan.n_tokens} slots")
        self.cache.put(plan.key, rows)
        return rows

    def encode_tiles(self, tiles: torch.Tensor) -> torch.Tensor:
        """Tiles (N, 3, S, S) through the encoder, uncached, at most BATCH_TILES at a time (the activations of a batch:
        ~45 MB a SmolVLM tile, ~250 MB a Gemma 3 image)."""
        if self._tower is None:
            return self.encode_reference(tiles)
        tower = self._tower
        return torch.cat([tower.forward(tiles[i:i + BATCH_TILES]) for i in range(0, tiles.shape[0], BATCH_TILES)])

    def encode_reference(self, tiles: torch.Tensor) -> torch.Tensor:
        """The PyTorch encoder (float32 weights from the file, loaded on first use)."""
        if self._weights is None:
            self._weights = float_weights(self.file)
        with torch.inference_mode():
            return encode_tiles(self._weights, self.config, tiles)


def load_projector(path: Path | str, precision: str = "exact", backend: str = "auto",
                   cache_bytes: int = DEFAULT_BYTES) -> Projector:
    """The projector GGUF at `path` (ProjectorError or GGUFError naming what is wrong with it)."""
    return Projector(read_projector(Path(path)), precision, backend, cache_bytes)


def _tower(pf: ProjectorFile, precision: str, required: bool) -> VisionHandle | None:
    from webchat.kernels.cpu import build

    kernels = build.load() if required else build.try_load()
    if kernels is None:
        print("webchat: vision encoder on PyTorch (the C++ kernels did not load)", file=sys.stderr, flush=True)
        return None
    return build_tower(kernels, pf, precision)


__all__ = ["ImagePlan", "Projector", "ProjectorConfig", "load_projector"]
