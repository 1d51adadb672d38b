"""Hostile .gguf files (issue 42): headers whose counts claim more than the file holds, built byte by byte."""

from __future__ import annotations

import struct
from pathlib import Path

UINT8, STRING, ARRAY = 0, 8, 9


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def array_bomb(path: Path, count: int = 1 << 60, size: int = 133, item: int = UINT8) -> Path:
    """A small file whose one key declares an array of `count` items (row 1: 2^60 bytes in 133; gguf's reader reads
    them one by one, and past the file's end each read is an empty array, never an error)."""
    body = header(0, 1) + _string("general.architecture") + struct.pack("<IIQ", ARRAY, item, count)
    path.write_bytes(body + b"\0" * max(0, size - len(body)))
    return path


def many_strings(path: Path, count: int = 2_000_000) -> Path:
    """A file whose one key holds `count` empty strings (row 2: 16 MB of lengths)."""
    body = header(0, 1) + _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, count)
    with path.open("wb") as f:
        f.write(body)
        f.write(b"\0" * (8 * count))
    return path
