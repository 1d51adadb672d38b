"""The vision fixtures (bench/vision_fixtures.py): the reduced-depth SmolVLM- and Gemma-3-shaped checkpoints and their
GGUFs, built once per machine (cached in $WEBCHAT_HOME/bench-files/vision), and transformers' reference on them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


def _build(name: str) -> Any:
    for module in ("transformers", "sentencepiece", "google.protobuf", "PIL"):
        pytest.importorskip(module, reason=f"the vision fixtures need {module} (the test extra)")
    import vision_fixtures

    try:
        return vision_fixtures.build(name)
    except (OSError, RuntimeError) as exc:  # no llama.cpp source (no PyPI), or its converter failed
        pytest.skip(f"fixture {name} could not be built: {str(exc).splitlines()[0]}")


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
