"""A vision model in --models-dir (webchat.serve.catalog): an mmproj*.gguf is no model of its own; it pairs with the
model file whose name its own names, or with the one model of its folder, and the model is listed as able to see."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from webchat.cli.serve import message_bytes
from webchat.serve.catalog import projector_for, scan
from webchat.serve.config import ServerConfig
from webchat.serve.images import IMAGE_MESSAGE_BYTES


def link(target: Path, at: Path) -> Path:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(target)
    return at


def test_projectors_pair_by_name_and_by_folder_and_are_never_listed(tmp_path: Path, smolvlm: Any, gemma3: Any,
                                                                    tiny_model_dir: Path) -> None:
    shelf = tmp_path / "models"
    link(smolvlm.text_gguf, shelf / "SmolVLM-256M-Instruct-Q8_0.gguf")
    link(smolvlm.mmproj_f16, shelf / "mmproj-SmolVLM-256M-Instruct-f16.gguf")
    link(gemma3.text_gguf, shelf / "SmolLM2-135M-Q8_0.gguf")  # a text model: no projector names it
    link(gemma3.text_gguf, shelf / "gemma-3-4b-it" / "gemma-3-4b-it-Q4_K_M.gguf")  # a downloaded repository
    link(gemma3.mmproj_f16, shelf / "gemma-3-4b-it" / "mmproj-model-f16.gguf")
    cards = scan(tiny_model_dir, shelf)
    vision = {name: card.wire(False)["vision"] for name, card in cards.items() if not card.default}
    assert vision == {"SmolLM2-135M-Q8_0": False, "SmolVLM-256M-Instruct-Q8_0": True, "gemma-3-4b-it-Q4_K_M": True}
    smol = cards["SmolVLM-256M-Instruct-Q8_0"]
    assert smol.projector is not None and smol.projector.name == "mmproj-SmolVLM-256M-Instruct-f16.gguf"
    assert smol.size_bytes == smolvlm.text_gguf.stat().st_size + smolvlm.mmproj_f16.stat().st_size
    gem = cards["gemma-3-4b-it-Q4_K_M"]
    assert gem.projector is not None and gem.projector.name == "mmproj-model-f16.gguf"


@pytest.mark.parametrize(("model", "projectors", "paired"), [
    ("SmolVLM-256M-Instruct-Q8_0", ["mmproj-SmolVLM-256M-Instruct-Q8_0", "mmproj-SmolVLM-500M-Instruct-f16"], 0),
    ("gemma-3-4b-it-q4_0", ["mmproj-gemma-3-f16", "mmproj-gemma-3-4b-it-f16"], 1),  # the longest name
    ("Qwen2.5-7B-Instruct-Q4_K_M", ["mmproj-SmolVLM-256M-Instruct-f16"], None),
])
def test_a_projector_pairs_with_the_model_its_name_begins(model: str, projectors: list[str],
                                                          paired: int | None) -> None:
    paths = [Path(f"{p}.gguf") for p in projectors]
    assert projector_for(Path(f"{model}.gguf"), paths) == (None if paired is None else paths[paired])


def test_frames_and_bodies_grow_only_where_a_model_reads_images(tmp_path: Path) -> None:
    assert message_bytes(None, None) == ServerConfig.max_message_bytes == 1 << 20
    assert message_bytes(tmp_path / "mmproj.gguf", None) == IMAGE_MESSAGE_BYTES
    (tmp_path / "text.gguf").write_bytes(b"")
    assert message_bytes(None, tmp_path) == 1 << 20
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm" / "mmproj-vlm-f16.gguf").write_bytes(b"")
    assert message_bytes(None, tmp_path) == IMAGE_MESSAGE_BYTES
