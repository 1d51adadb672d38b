"""A `.gguf` given as --model: converted once into $WEBCHAT_HOME/gguf-models/<stem>-<key>/, key from the file's hash.

The folder is what webchat.gguf.convert writes (float32 model.safetensors, the Q4_0/Q4_1/Q5/Q8_0 and Q4-6_K blocks as
they are in quantized.safetensors, every other type dequantized once; past 4 GiB of float32, an 8B file's 32 GB, the
blocks only in quantized.safetensors and decoded at load where float32 weights are asked for), written a tensor at a
time, built under a temporary name and renamed into place, so a folder that exists is complete. The hash of a file is
remembered by (path, size, mtime) in index.json beside the folders, so a second start reads no weights until the model
loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TextIO

from webchat.files.home import webchat_home
from webchat.gguf.convert import convert_gguf
from webchat.gguf.header import keep_none, read_header

KEY_HEX = 16  # hex digits of the SHA-256 that name a cache folder
CHUNK = 8 << 20


def gguf_models_dir(home: Path | None = None) -> Path:
    return (home if home is not None else webchat_home()) / "gguf-models"


def model_name(folder: Path, home: Path | None = None) -> str:
    """What a model folder is called (the page's picker, the API's `model`): its name, except that a folder this
    module converted from a .gguf is called by the file's name, as a .gguf in --models-dir is, not by its cache key."""
    stem, _, key = folder.name.rpartition("-")
    converted = folder.parent.resolve() == gguf_models_dir(home).resolve()
    if converted and stem and len(key) == KEY_HEX and all(c in "0123456789abcdef" for c in key):
        return stem
    return folder.name


class Progress:
    """`label: 42%` on one terminal line (a new line per 25% where the stream is not a terminal)."""

    def __init__(self, label: str, out: TextIO | None = None) -> None:
        self.label, self.out, self.shown = label, out if out is not None else sys.stderr, 0
        self.step = 1 if self.out.isatty() else 25

    def __call__(self, done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct // self.step <= self.shown // self.step:
            return
        self.shown = pct
        tty = self.step == 1
        start, end = ("\r", "\n" if pct == 100 else "") if tty else ("", "\n")
        print(f"{start}webchat: {self.label}: {pct}%", end=end, file=self.out, flush=True)


def model_folder(path: Path, home: Path | None = None, out: TextIO | None = None) -> Path:
    """The model folder for --model: a folder as it is, a .gguf file converted once into the cache (its folder)."""
    path = Path(path).expanduser()
    if path.is_dir():
        return path
    if not path.exists():
        raise FileNotFoundError(f"--model {path} does not exist (expected a model folder or a .gguf file)")
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"--model {path}: expected a model folder or a .gguf file, got {path.suffix or 'a'} file")
    read_header(path, keep=keep_none)  # a bad header is named before the file is hashed or converted
    root = gguf_models_dir(home)
    dest = root / f"{path.stem}-{file_key(path, root, out)}"
    if dest.is_dir():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert_gguf(path, tmp, progress=Progress(f"converting {path.name} (once) into {dest}", out))
        try:
            tmp.rename(dest)
        except OSError:
            if not dest.is_dir():  # not another process that finished the same conversion first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def file_key(path: Path, root: Path, out: TextIO | None = None) -> str:
    """The first KEY_HEX hex digits of the file's SHA-256, remembered by (resolved path, size, mtime)."""
    st = path.stat()
    ident = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    index_path = root / "index.json"
    index: dict[str, dict[str, object]] = {}
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass  # no index yet, or a damaged one: hash again
    where = str(path.resolve())
    seen = index.get(where) if isinstance(index, dict) else None
    if isinstance(seen, dict) and all(seen.get(k) == v for k, v in ident.items()) and isinstance(seen.get("key"), str):
        return str(seen["key"])
    key = sha256_file(path, Progress(f"hashing {path.name}", out))[:KEY_HEX]
    index = index if isinstance(index, dict) else {}
    index[where] = {**ident, "key": key}
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".index.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    tmp.replace(index_path)
    return key


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    h, total, done = hashlib.sha256(), path.stat().st_size, 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    if progress is not None and total == 0:
        progress(1, 1)
    return h.hexdigest()
