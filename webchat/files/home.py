"""Where webchat keeps its per-user files: the model cache under $WEBCHAT_HOME (default ~/.cache/webchat)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def webchat_home() -> Path:
    """$WEBCHAT_HOME if set and non-empty, else ~/.cache/webchat (not created here)."""
    env = os.environ.get("WEBCHAT_HOME", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "webchat"


def models_dir(home: Path | None = None) -> Path:
    return (home if home is not None else webchat_home()) / "models"


def gguf_dir(home: Path | None = None) -> Path:
    return (home if home is not None else webchat_home()) / "gguf"


def default_model_dir(home: Path | None = None) -> Path:
    """The converted Hugging Face-style folder of the default model: <home>/models/SmolLM2-135M-Instruct."""
    return models_dir(home) / DEFAULT_MODEL_NAME


def default_gguf_path(home: Path | None = None) -> Path:
    """The original GGUF the default model was converted from: <home>/gguf/SmolLM2-135M-Instruct.Q4_1.gguf."""
    return gguf_dir(home) / DEFAULT_GGUF_NAME
