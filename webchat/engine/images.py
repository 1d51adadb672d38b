"""Images in a prompt as the engine sees them (issue 61): where each image's slots are, the key its KV pages are
cached under, and its embedding rows, made on the device thread when the prefill first reaches them.

    image = ImageInput(key, spans=((12, 64), (78, 64)), encode=lambda: rows, bidirectional=False)
    images = PromptImages([image, ...], len(prompt))
    images.cache_ids(prompt)     # the prompt with each slot's id replaced by its image's key id (negative: no token's),
                                 # what the prefix cache keys pages by: two images never share pages, one image always
    images.chunk_end(start, end) # a prefill chunk's end moved off the inside of a run of slots (one chunk each)
    images.ensure(start, end)    # the images [start, end) overlaps, encoded if not yet (seconds spent)
    images.placed(start, n)      # the batch's Placed rows of new tokens [start, start + n), or None

A run of slots is one image's contiguous slot tokens (SmolVLM: one per tile; Gemma 3: the image's 256). Where the
image attends both ways (Gemma 3: `causal OR same image`, sliding layers `window AND (causal OR same image)`), each
slot of a run attends to the run's end: its `key_end`.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from webchat.model.batch import Placed


@dataclass(eq=False)
class ImageInput:
    """One image of a prompt: its runs of slots, its content key, and how to get its rows (on the device thread)."""

    key: str  # the image's content hash and every setting its rows depend on (webchat.vision's plan key)
    spans: tuple[tuple[int, int], ...]  # (first prompt position, count) of each run of its slots, in order
    encode: Callable[[], torch.Tensor]  # its rows (n_tokens, dim) float32, runs in order; called on the device thread
    bidirectional: bool = False  # a run's slots attend to each other both ways (Gemma 3)
    rows: torch.Tensor | None = None  # set by PromptImages.ensure; shared with the projector's cache: never changed

    @property
    def n_tokens(self) -> int:
        return sum(count for _, count in self.spans)

    @property
    def key_id(self) -> int:
        """The id its slots have in the prefix cache's keys: negative (no token has it), 60 bits of the key's hash."""
        return -1 - int(hashlib.sha256(self.key.encode()).hexdigest()[:15], 16)


def _same(rows: torch.Tensor) -> torch.Tensor:
    return rows


@dataclass(frozen=True)
class _Run:
    start: int
    count: int
    image: ImageInput
    row: int  # its first row in image.rows

    @property
    def end(self) -> int:
        return self.start + self.count


class PromptImages:
    """A sequence's images: its prompt's runs of slots, in order."""

    def __init__(self, images: list[ImageInput], prompt_len: int) -> None:
        runs: list[_Run] = []
        for i, image in enumerate(images):
            row = 0
            for start, count in image.spans:
                if count < 1 or start < 0 or start + count > prompt_len:
                    raise ValueError(f"image {i}'s slots ({start}, {count}) must be at least one position inside the "
                                     f"prompt of {prompt_len} tokens")
                runs.append(_Run(start, count, image, row))
                row += count
        runs.sort(key=lambda r: r.start)
        for a, b in zip(runs, runs[1:], strict=False):
            if b.start < a.end:
                raise ValueError(f"two images' slots overlap: positions {a.start}..{a.end - 1} and {b.start}..")
        self.images, self.runs = images, runs
        self.encode_s = 0.0  # seconds spent encoding this sequence's images

    @property
    def n_tokens(self) -> int:
        return sum(r.count for r in self.runs)

    def cache_ids(self, tokens: list[int]) -> list[int]:
        """tokens with each slot's id replaced by its image's key id (the prefix cache's keys)."""
        out = list(tokens)
        for r in self.runs:
            out[r.start : r.end] = [r.image.key_id] * r.count
        return out

    def chunk_end(self, start: int, end: int) -> int:
        """A prefill chunk [start, end)'s end, moved off the inside of a run: back to the run's start where the chunk
        holds something before it, else on to the run's end (a run is prefilled whole, in one chunk)."""
        for r in self.runs:
            if r.start < end < r.end:
                return r.start if r.start > start else r.end
        return end

    def ensure(self, start: int, end: int) -> float:
        """The images whose slots [start, end) overlaps, encoded where they are not yet; the seconds it took."""
        spent = 0.0
        for r in self.runs:
            if r.start < end and start < r.end and r.image.rows is None:
                began = time.perf_counter()
                rows = r.image.encode()
                spent += time.perf_counter() - began
                if rows.dim() != 2 or rows.shape[0] != r.image.n_tokens:
                    raise ValueError(f"the image's encoder gave rows of shape {tuple(rows.shape)}; its "
                                     f"{r.image.n_tokens} slots need ({r.image.n_tokens}, dim)")
                r.image.rows = rows
                r.image.encode = functools.partial(_same, rows)  # what it held (an image's tiles) goes now
        self.encode_s += spent
        return spent

    def placed(self, start: int, n: int) -> Placed | None:
        """The rows and key ends of new tokens [start, start + n) (their images encoded: ensure), or None when none
        of them is a slot."""
        end = start + n
        offsets: list[int] = []
        rows: list[torch.Tensor] = []
        key_ends: list[int] | None = None
        for r in self.runs:
            lo, hi = max(r.start, start), min(r.end, end)
            if lo >= hi:
                continue
            image_rows = r.image.rows
            if image_rows is None:
                raise RuntimeError(f"the image at positions {r.start}..{r.end - 1} is not encoded (ensure first)")
            offsets += range(lo - start, hi - start)
            rows.append(image_rows[r.row + lo - r.start : r.row + hi - r.start])
            if r.image.bidirectional:
                if r.end > end:
                    raise ValueError(f"a chunk ending at {end} cuts the image at {r.start}..{r.end - 1}, whose slots "
                                     "attend both ways (chunk_end keeps a run whole)")
                if key_ends is None:
                    key_ends = list(range(start + 1, end + 1))
                key_ends[lo - start : hi - start] = [r.end] * (hi - lo)
        if not offsets:
            return None
        return Placed(offsets, torch.cat(rows).float().contiguous(), key_ends)
