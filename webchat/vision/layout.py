"""An image's place in the prompt: the text and special tokens around its embedding slots, as transformers'
processors write them, and the chat template's image marker each layout replaces.

idefics3 (Idefics3Processor.replace_image_token), tokens t = 64 a tile, grid r x c:
    per row i, per column j: <fake_token_around_image><row_i_col_j> <image>*t; then "\n" after each row;
    then "\n<fake_token_around_image><global-img>" <image>*t "<fake_token_around_image>"
    one image alone (no grid): <fake_token_around_image><global-img> <image>*t <fake_token_around_image>
    marker: "<image>" (the template's); slot token: "<image>"
gemma3 (Gemma3Processor.full_image_sequence):
    "\n\n<start_of_image>" <image_soft_token>*256 "<end_of_image>\n\n"
    marker: "<start_of_image>"; slot token: "<image_soft_token>"

Gemma 3's newlines belong to the text around the image: "user\n" + "\n\n" is one token in its vocabulary, so the layout
must be tokenized inside the prompt's text (`expand`), never on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

MARKER = {"idefics3": "<image>", "gemma3": "<start_of_image>"}
SLOT = {"idefics3": "<image>", "gemma3": "<image_soft_token>"}


@dataclass(frozen=True)
class Slots:
    """`count` consecutive positions that take the image's embedding rows, in order."""

    count: int


Segment = str | Slots


def layout(kind: str, rows: int, cols: int, tokens: int) -> tuple[Segment, ...]:
    """The segments of one image: text and slots, adjacent texts merged."""
    if kind == "gemma3":
        return ("\n\n<start_of_image>", Slots(tokens), "<end_of_image>\n\n")
    if kind != "idefics3":
        raise ValueError(f"no layout for projector kind {kind!r}; expected idefics3 or gemma3")
    fake, glob = "<fake_token_around_image>", "<global-img>"
    parts: list[Segment] = []
    for i in range(rows):
        for j in range(cols):
            parts += [f"{fake}<row_{i + 1}_col_{j + 1}>", Slots(tokens)]
        parts.append("\n")
    parts += ["\n" if rows else "", f"{fake}{glob}", Slots(tokens), fake]
    return merge(parts)


def merge(parts: list[Segment]) -> tuple[Segment, ...]:
    out: list[Segment] = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] = out[-1] + p
        elif p != "":
            out.append(p)
    return tuple(out)


def as_text(segments: tuple[Segment, ...], slot_token: str) -> str:
    """The segments as prompt text, each slot written as the slot token."""
    return "".join(s if isinstance(s, str) else slot_token * s.count for s in segments)


def expand(prompt: str, kind: str, layouts: list[tuple[Segment, ...]], marker: str | None = None) -> str:
    """`prompt` (a rendered chat template) with its image markers replaced, in order, by the images' layouts; a count
    of markers other than the images' is a ValueError naming both. `marker` (default: the family's, which a user may
    also type) lets a caller that rendered its own unforgeable placeholder expand only that."""
    marker = MARKER[kind] if marker is None else marker
    if not marker:
        raise ValueError("the image marker must not be empty")
    pieces = prompt.split(marker)
    if len(pieces) - 1 != len(layouts):
        raise ValueError(f"the prompt has {len(pieces) - 1} image markers {marker!r}; {len(layouts)} images were given")
    out = [pieces[0]]
    for seg, rest in zip(layouts, pieces[1:], strict=True):
        out += [as_text(seg, SLOT[kind]), rest]
    return "".join(out)
