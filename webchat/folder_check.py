"""Checks a model folder before its weights load: one clear line naming the file and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ModelFolderError(ValueError):
    """A model folder webchat cannot use; the message names the file."""


def read_json_file(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or ModelFolderError naming the file, the line and what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFolderError(f"{path}: expected this file, found none") from None
    except UnicodeDecodeError as exc:
        raise ModelFolderError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except OSError as exc:
        raise ModelFolderError(f"{path}: cannot be read: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def check_model_folder(folder: Path) -> None:
    """config.json, tokenizer.json and the tokenizer (with its chat template) load; the weights file is there."""
    from webchat.model.config import ModelArgs, ModelConfigError
    from webchat.text.tokenizer import Tokenizer

    if not folder.is_dir():
        raise ModelFolderError(f"{folder}: expected a model folder, found {'a file' if folder.exists() else 'nothing'}")
    cfg_path = folder / "config.json"
    try:
        ModelArgs.from_dict(read_json_file(cfg_path), name=folder.name)
    except (ModelConfigError, KeyError, TypeError, ValueError) as exc:
        raise ModelFolderError(f"{cfg_path}: {exc}") from None
    tok_path = folder / "tokenizer.json"
    read_json_file(tok_path)
    for name in ("tokenizer_config.json", "generation_config.json"):
        if (folder / name).exists():
            read_json_file(folder / name)
    try:
        Tokenizer.from_dir(folder)
    except Exception as exc:  # the tokenizers library's own errors are plain Exceptions
        raise ModelFolderError(f"{tok_path}: the tokenizer does not load: {type(exc).__name__}: {exc}") from None
    if not any((folder / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json")):
        raise ModelFolderError(f"{folder}: expected model.safetensors (or model.safetensors.index.json), found none")
