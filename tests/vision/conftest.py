"""The vision fixtures (bench.vision_fixtures): the reduced-depth SmolVLM- and Gemma-3-shaped checkpoints and their
GGUFs, built once per machine (cached in $WEBCHAT_HOME/bench-files/vision), and transformers' reference on them."""

from __future__ import annotations

from typing import Any

import pytest

from bench import vision_fixtures


def _build(name: str) -> Any:
    """The fixture, built (transformers, then llama.cpp's converter from the llama-cpp-python source) or cached."""
    return vision_fixtures.build(name)


@pytest.fixture(scope="session")
def smolvlm() -> Any:
    """The SmolVLM-256M-shaped fixture, 2 vision and 2 text layers."""
    return _build("smolvlm-mini")


@pytest.fixture(scope="session")
def gemma3() -> Any:
    """The Gemma-3-shaped fixture (SigLIP at 896, 256 tokens), 1 vision and 2 text layers."""
    return _build("gemma3-mini")


@pytest.fixture(scope="session")
def fixtures(smolvlm: Any, gemma3: Any) -> dict[str, Any]:
    return {"idefics3": smolvlm, "gemma3": gemma3}
