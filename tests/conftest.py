"""Shared fixtures: the tiny random model (fast) and the converted default model (truth)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from webchat.files.pull import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def real_gguf_path(real_model_dir: Path) -> Path:
    from webchat.files.home import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def kernels() -> Any:
    """The C++ kernels (webchat.kernels.cpu), built or loaded once; a test that needs them is skipped, naming why,
    where no toolchain can build them."""
    from webchat.kernels.cpu import build as qkernels

    try:
        return qkernels.load()
    except qkernels.KernelsUnavailable as exc:
        pytest.skip(f"no C++ toolchain here: {exc}")
