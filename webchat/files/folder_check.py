"""Checks a model folder before its weights load: one clear line naming the file and what is wrong."""

from __future__ import annotations

import hashlib
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
    for path in sorted(folder.glob("*.safetensors")):
        check_safetensors(path)
    check_recorded_files(folder)


HEAD_BYTES = 1 << 20  # the part of each file whose sha256 `.complete` records


def file_record(path: Path) -> dict[str, object]:
    """What `.complete` records of a file it vouches for: its size and the sha256 of its first MiB."""
    with path.open("rb") as f:
        head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
    return {"size": path.stat().st_size, "head_sha256": head}


def check_recorded_files(folder: Path) -> None:
    """Each file `.complete` recorded still has its size and first MiB (a marker from before the records: nothing to
    compare, it passes)."""
    try:
        marker = json.loads((folder / ".complete").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    files = marker.get("files") if isinstance(marker, dict) else None
    for name, want in (files or {}).items():
        path = folder / name
        if not path.is_file():
            raise ModelFolderError(f"{path}: missing, though the folder was marked complete; {FIX}")
        got = file_record(path)
        if got["size"] != want.get("size"):
            raise ModelFolderError(f"{path}: {got['size']} bytes, {want.get('size')} when it was written "
                                   f"(truncated or replaced); {FIX}")
        if got["head_sha256"] != want.get("head_sha256"):
            raise ModelFolderError(f"{path}: its first MiB changed since it was written (corrupt); {FIX}")


FIX = "`webchat pull --force` fetches and converts the default model again"


def check_safetensors(path: Path) -> None:
    """The file's header parses and its tensors' data fits inside the file: a truncated or corrupt file is one line
    naming it, not a SafetensorError from deep inside the loader."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if n < 2 or 8 + n > size:
                raise ModelFolderError(f"{path}: truncated or not a safetensors file ({size} bytes, header of "
                                       f"{max(n, 0)} bytes announced); {FIX}")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise ModelFolderError(f"{path}: cannot be read: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError):
        raise ModelFolderError(f"{path}: its safetensors header is not valid JSON (corrupt); {FIX}") from None
    if not isinstance(header, dict):
        raise ModelFolderError(f"{path}: its safetensors header is not a JSON object (corrupt); {FIX}")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ModelFolderError(f"{path}: tensor {name!r} has no valid data_offsets (corrupt); {FIX}")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise ModelFolderError(f"{path}: truncated: its tensors need {8 + n + end} bytes, the file has {size}; {FIX}")
