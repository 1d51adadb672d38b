"""Preprocessing and prompt layout against transformers' processors on the fixtures: the same pixel values (tiles,
their order, the global image last) and the same input_ids for several image sizes and tile limits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.vision.pictures import as_image, picture
from webchat.vision.layout import expand
from webchat.vision.preprocess import grid, resized_size
from webchat.vision.projector import Projector, load_projector

PROMPTS = {
    "idefics3": "<|im_start|>User:<image>What is in this picture?<end_of_utterance>\nAssistant:",
    "gemma3": "<bos><start_of_turn>user\n<start_of_image>What is in this picture?<end_of_turn>\n<start_of_turn>model\n",
}


@pytest.fixture(scope="module")
def projectors(fixtures: dict[str, Any]) -> dict[str, Projector]:
    return {k: load_projector(fx.mmproj_f16, backend="torch") for k, fx in fixtures.items()}


@pytest.fixture(scope="module")
def processors(fixtures: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoProcessor

    return {k: AutoProcessor.from_pretrained(fx.hf_dir) for k, fx in fixtures.items()}


CASES = [  # (kind, width, height, max_tiles, tiles expected incl. the global image)
    ("idefics3", 2048, 512, 16, 5),
    ("idefics3", 640, 480, 16, 13),
    ("idefics3", 300, 900, 16, 9),
    ("idefics3", 7, 5, 16, 13),
    ("idefics3", 2048, 512, 2, 3),
    ("idefics3", 800, 600, 4, 5),
    ("idefics3", 512, 512, 1, 1),
    ("gemma3", 2048, 512, 16, 1),
    ("gemma3", 333, 1000, 16, 1),
]


@pytest.mark.parametrize(("kind", "width", "height", "max_tiles", "n_tiles"), CASES)
def test_tiles_and_input_ids_are_the_processors(projectors: dict[str, Projector], processors: dict[str, Any],
                                                kind: str, width: int, height: int, max_tiles: int,
                                                n_tiles: int) -> None:
    proj, proc = projectors[kind], processors[kind]
    pil = picture(width, height, seed=width + height)
    plan = proj.plan(as_image(pil), max_tiles=max_tiles)
    kwargs: dict[str, Any] = {}
    if kind == "idefics3":
        edge = proj.config.longest_edge
        while edge > proj.image_size and grid(width, height, edge, proj.image_size)[0] * grid(
                width, height, edge, proj.image_size)[1] > max_tiles:
            edge -= proj.image_size  # the processor's size for this limit, found independently of pick_longest_edge
        kwargs["size"] = {"longest_edge": edge}
    ref = proc(text=PROMPTS[kind], images=[pil], return_tensors="pt", add_special_tokens=False, **kwargs)
    pixels = ref["pixel_values"].reshape(-1, 3, proj.image_size, proj.image_size)
    assert plan.tiles.shape == (n_tiles, 3, proj.image_size, proj.image_size)
    assert pixels.shape == plan.tiles.shape
    assert torch.equal(plan.tiles, pixels), f"max |d| {(plan.tiles - pixels).abs().max().item()}"
    ours = proc.tokenizer(expand(PROMPTS[kind], kind, [plan.layout]), add_special_tokens=False)["input_ids"]
    assert ours == ref["input_ids"][0].tolist()
    slot_id = proc.tokenizer.convert_tokens_to_ids(proj.slot_token)
    assert ours.count(slot_id) == plan.n_tokens == n_tiles * proj.tokens_per_tile


def test_two_images_in_one_prompt_expand_in_order(projectors: dict[str, Projector], processors: dict[str, Any]) -> None:
    proj, proc = projectors["idefics3"], processors["idefics3"]
    a, b = picture(1024, 512, 1), picture(512, 1024, 2)
    text = "<|im_start|>User:<image>and<image>Compare.<end_of_utterance>\nAssistant:"
    ref = proc(text=text, images=[a, b], return_tensors="pt", add_special_tokens=False)
    layouts = [proj.plan(as_image(a)).layout, proj.plan(as_image(b)).layout]
    ours = proc.tokenizer(expand(text, "idefics3", layouts), add_special_tokens=False)["input_ids"]
    assert ours == ref["input_ids"][0].tolist()
    with pytest.raises(ValueError, match="2 image markers"):
        expand(text, "idefics3", layouts[:1])
    private = text.replace("<image>", "\x00img\x00", 1) + " a typed <image>"
    mixed = expand(private, "idefics3", layouts[:1], marker="\x00img\x00")
    assert mixed.count("<global-img>") == 1 and mixed.endswith(" a typed <image>")


def test_the_long_side_goes_to_2048_and_tiles_are_row_major() -> None:
    assert resized_size(512, 2048, 2048) == (512, 2048)
    assert resized_size(480, 640, 2048) == (1536, 2048)
    assert grid(640, 480, 2048, 512) == (3, 4)
    assert grid(300, 900, 2048, 512) == (4, 2)
    assert grid(512, 512, 512, 512) == (0, 0)


def test_max_tiles_must_be_positive(projectors: dict[str, Projector]) -> None:
    with pytest.raises(ValueError, match="max_tiles must be at least 1; got 0"):
        projectors["idefics3"].plan(as_image(picture(64, 64)), max_tiles=0)
