"""Shared fixtures: the tiny random model (fast) and the converted default model (truth)."""

from __future__ import annotations

from pathlib import Path

import pytest

from webchat.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from webchat.pull import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def real_gguf_path(real_model_dir: Path) -> Path:
    from webchat.pull import default_gguf_path

    return default_gguf_path()
