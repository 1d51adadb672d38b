"""The model catalog: each model folder and .gguf described from its files without loading it, every entry with limits
and a deadline, so that no file in --models-dir (a header bomb, a symbolic link loop, a FIFO, a file on a hung disk)
can hold start-up.

    scan(default, dir) = {name: Card}: the default first, then each entry of dir, described by DESCRIBE_THREADS daemon
                         threads; an entry not described within DESCRIBE_TIMEOUT_S, or that cannot be, is left out
                         with one log line naming the file and what was wrong
A .gguf is described by webchat.gguf.header (every count checked against the bytes left, caps on the header's size,
strings and time); a folder from its config.json (at most CONFIG_BYTES) and its safetensors headers (at most
SAFETENSORS_HEADER_BYTES, safetensors' own limit).

A vision model's projector (`mmproj*.gguf`, llama.cpp's name) is no model of its own: it pairs with the model beside it
and the model is listed as able to see (`vision`). In a model folder, or a folder holding one model .gguf, the folder's
one `mmproj*.gguf`; at the top of the directory, the `mmproj-<name>[-f16|-q8_0|...].gguf` whose <name> begins the
model file's name (the longest such name where several do).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import queue
import re
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from webchat.files.gguf_cache import model_name
from webchat.gguf.header import os_words, read_header

log = logging.getLogger("webchat.serve.models")

CONFIG_BYTES = 16 << 20  # a config.json is a few KiB
SAFETENSORS_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header
DESCRIBE_TIMEOUT_S = 10.0  # one entry of --models-dir
DESCRIBE_THREADS = 4


class BadEntry(ValueError):
    """A catalog entry that cannot be described; the message says what is wrong, in words."""


@dataclass
class Card:
    """A model in the catalog, described from its files without loading it."""

    name: str
    path: Path  # a model folder or a .gguf file
    size_bytes: int  # the weight files it runs from
    architecture: str
    weights: str  # the commonest weight format: "q4_1", "q4_k", "float32", ...
    context_length: int | None
    default: bool = False
    kv_per_token: int | None = None  # bytes of k and v a token takes in a float32 pool; None: shape unknown
    projector: Path | None = None  # its mmproj .gguf: the model reads images (webchat.serve.images)

    def wire(self, loaded: bool) -> dict[str, Any]:
        return {"name": self.name, "size_bytes": self.size_bytes, "architecture": self.architecture,
                "weights": self.weights, "context_length": self.context_length, "default": self.default,
                "loaded": loaded, "vision": self.projector is not None}


def _div(a: Any, b: Any) -> int | None:
    return a // b if isinstance(a, int) and isinstance(b, int) and b > 0 else None


def kv_bytes(layers: Any, kv_heads: Any, key_len: Any, value_len: Any) -> int | None:
    """Float32 bytes of one token's k and v over all layers (kv_cache.kv_bytes_per_token's count from a model's
    metadata); a per-layer list of kv heads (some GGUFs) counts each layer's own; None when a figure is missing."""
    if isinstance(kv_heads, list):
        kv_heads = sum(int(h) for h in kv_heads) / len(kv_heads) if kv_heads else None
    if not all(isinstance(v, (int, float)) and v > 0 for v in (layers, kv_heads, key_len, value_len)):
        return None
    return int(4 * layers * kv_heads * (key_len + value_len))


def _json_file(path: Path, limit: int) -> dict[str, Any]:
    size = path.stat().st_size
    if size > limit:
        raise BadEntry(f"{path.name} is {size} bytes; a model's is a few KiB (at most {limit} are read)")
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadEntry(f"{path.name} is not valid JSON ({exc})") from None
    except RecursionError:
        raise BadEntry(f"{path.name} nests deeper than a JSON reader follows") from None
    if not isinstance(data, dict):
        raise BadEntry(f"{path.name} holds a JSON {type(data).__name__}, not an object")
    return data


def _safetensors_metadata(path: Path) -> dict[str, str]:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadEntry(f"{path.name} is {len(head)} bytes long, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        left = path.stat().st_size - 8
        if n > min(left, SAFETENSORS_HEADER_BYTES):
            raise BadEntry(f"{path.name} declares a {n}-byte header; the file has {left} bytes after its length "
                           f"and safetensors allows {SAFETENSORS_HEADER_BYTES}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadEntry(f"{path.name}'s header is not valid JSON ({exc})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def _describe_gguf(path: Path, default: bool) -> Card:
    header = read_header(path)
    meta = header.metadata

    def num(key: str) -> Any:
        value = meta.get(key)
        return value if isinstance(value, int | float | list) and not isinstance(value, bool) else None

    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise BadEntry(f"{path.name}: its metadata names no general.architecture; not a model file")
    if not header.tensors:
        raise BadEntry(f"{path.name}: it holds no tensors; not a model file")
    kinds = Counter(t.type_name for t in header.tensors if len(t.shape) > 1)
    ctx, heads, width = num(f"{arch}.context_length"), num(f"{arch}.attention.head_count"), num(
        f"{arch}.embedding_length")
    kv = kv_bytes(num(f"{arch}.block_count"), num(f"{arch}.attention.head_count_kv") or heads,
                  num(f"{arch}.attention.key_length") or _div(width, heads),
                  num(f"{arch}.attention.value_length") or _div(width, heads))
    return Card(path.stem, path, path.stat().st_size, arch, kinds.most_common(1)[0][0] if kinds else "unknown",
                ctx if isinstance(ctx, int) else None, default, kv)


def _describe_folder(path: Path, default: bool) -> Card:
    config = path / "config.json"
    if not config.is_file():
        raise BadEntry(f"{path}: neither a model folder (config.json) nor a .gguf file")
    cfg = _json_file(config, CONFIG_BYTES)
    archs = cfg.get("architectures")
    arch = str(archs[0]) if isinstance(archs, list) and archs else "unknown"
    quantized = path / "quantized.safetensors"
    if quantized.is_file():
        try:
            kinds = Counter(json.loads(_safetensors_metadata(quantized).get("webchat.model.quant", "{}")).values())
        except (json.JSONDecodeError, TypeError, AttributeError):
            raise BadEntry(f"{quantized.name}'s webchat.model.quant metadata is not a JSON object of formats") from None
        weights = str(kinds.most_common(1)[0][0]) if kinds else "quantized"
        size = quantized.stat().st_size
    else:
        weights = str(cfg.get("torch_dtype") or "float32")
        size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    ctx = cfg.get("max_position_embeddings")
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or _div(cfg.get("hidden_size"), heads)
    kv = kv_bytes(cfg.get("num_hidden_layers"), cfg.get("num_key_value_heads") or heads, head_dim, head_dim)
    return Card(model_name(path), path, size, arch, weights, ctx if isinstance(ctx, int) else None, default, kv)


def describe(path: Path, default: bool = False) -> Card:
    """A folder (config.json, its safetensors; or one model .gguf in it) or a .gguf (its metadata and tensor table),
    with the projector a folder holds; ValueError saying what is wrong otherwise (BadEntry, GGUFError)."""
    try:
        if path.suffix == ".gguf" and not path.is_dir():
            return _describe_gguf(path, default)
        inside = _projector_inside(path)
        gguf = _gguf_inside(path) if not (path / "config.json").exists() else None
        card = _describe_gguf(gguf, default) if gguf is not None else _describe_folder(path, default)
        return card if inside is None else dataclasses.replace(card, projector=inside,
                                                               size_bytes=card.size_bytes + inside.stat().st_size)
    except OSError as exc:
        raise BadEntry(f"{path.name}: cannot be read: {os_words(exc)}") from None
    except RecursionError:
        raise BadEntry(f"{path.name}: nests deeper than its reader follows") from None


def is_projector(path: Path) -> bool:
    """A vision model's projector file by llama.cpp's name for it (`mmproj-*.gguf`, `mmproj.gguf`)."""
    return path.suffix == ".gguf" and path.name.lower().startswith("mmproj")


def _projector_inside(folder: Path) -> Path | None:
    """The one mmproj*.gguf a model folder holds (several: the first by name, logged)."""
    try:
        found = sorted(p for p in folder.iterdir() if is_projector(p) and p.is_file())
    except OSError:
        return None
    if len(found) > 1:
        log.warning("models dir: %s holds %d projectors; %s pairs with its model", folder, len(found), found[0].name)
    return found[0] if found else None


def _gguf_inside(folder: Path) -> Path | None:
    """The one model .gguf of a folder without config.json (a downloaded GGUF repository)."""
    try:
        found = sorted(p for p in folder.iterdir() if p.suffix == ".gguf" and not is_projector(p) and p.is_file())
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


_TYPE_SUFFIX = re.compile(r"[-_.](f16|f32|bf16|q8_0|q4_0|q4_1|q5_0|q5_1|q4_k_m|q5_k_m|q6_k|model)$", re.IGNORECASE)


def projector_for(model: Path, projectors: list[Path]) -> Path | None:
    """The top-level projector whose name (`mmproj-<name>[-type].gguf`) begins the model file's; the longest name."""
    stem = model.stem.lower()
    best: tuple[int, Path] | None = None
    for p in projectors:
        base = _TYPE_SUFFIX.sub("", p.stem.lower().removeprefix("mmproj").lstrip("-_."))
        if base and stem.startswith(base) and (best is None or len(base) > best[0]):
            best = (len(base), p)
    return best[1] if best is not None else None


def _candidate(path: Path) -> bool:
    """A model folder (config.json, or one model .gguf in it) or a .gguf by its name and kind, never a projector (a
    symbolic link loop and the like answer False to is_dir and are then judged by their name: a bad .gguf is
    described, and named, like any other)."""
    if path.name.startswith(".") or is_projector(path):
        return False
    try:
        return (path.is_dir() and ((path / "config.json").exists() or _gguf_inside(path) is not None)) \
            or path.suffix == ".gguf"
    except OSError:
        return path.suffix == ".gguf"


def _broken_link(path: Path) -> str | None:
    """What is wrong with a symbolic link that leads nowhere (a loop, a missing target); None for anything else."""
    if path.name.startswith(".") or not path.is_symlink():
        return None
    try:
        path.resolve(strict=True)
    except RuntimeError:  # a loop, before Python 3.13
        return "a symbolic link loop"
    except OSError as exc:
        return "a symbolic link loop" if exc.errno == errno.ELOOP else "a symbolic link to nothing"
    return None


def describe_all(paths: list[Path], timeout: float = DESCRIBE_TIMEOUT_S,
                 describe_one: Callable[[Path], Card] = describe) -> list[Card | str]:  # fmt: skip
    """Each path's Card, or why it is left out, in order; DESCRIBE_THREADS daemon threads, each entry given
    `timeout` seconds from its start (a thread stuck past it is left behind and replaced)."""
    results: list[Card | str | None] = [None] * len(paths)
    started: dict[int, float] = {}
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(paths)):
        todo.put(i)
    cond = threading.Condition()

    def work() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            with cond:
                started[i] = time.monotonic()
            try:
                out: Card | str = describe_one(paths[i])
            except Exception as exc:  # noqa: BLE001 - every failure is this entry's, named and skipped
                out = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            with cond:
                if results[i] is None:
                    results[i] = out
                cond.notify_all()

    def spawn() -> None:
        threading.Thread(target=work, name="webchat-describe", daemon=True).start()

    for _ in range(min(DESCRIBE_THREADS, len(paths))):
        spawn()
    with cond:
        while any(r is None for r in results):
            now = time.monotonic()
            for i, t0 in started.items():
                if results[i] is None and now - t0 > timeout:
                    results[i] = f"describing it took more than {timeout:g} s"
                    spawn()  # its thread is stuck on this entry: another takes the rest of the queue
            cond.wait(0.05)
    return [r for r in results if r is not None]


def scan(default: Path, models_dir: Path | None, timeout: float = DESCRIBE_TIMEOUT_S) -> dict[str, Card]:
    """The default model first, then each model folder and .gguf in models_dir (by name; a name seen first wins,
    and the default's own folder is not listed twice). Bad entries are left out, each with one log line."""
    cards = {(card := describe(default, default=True)).name: card}
    if models_dir is None or not models_dir.is_dir():
        return cards
    seen = {default.resolve()}
    paths = []
    projectors = sorted(p for p in models_dir.iterdir() if is_projector(p) and not p.is_dir())
    for path in sorted(models_dir.iterdir()):
        broken = _broken_link(path)
        if broken is not None and path.suffix != ".gguf":  # a .gguf is described, and named, like any other
            log.warning("models dir: %s left out: %s", path, broken)
            continue
        if not _candidate(path):
            continue
        try:
            if path.resolve(strict=False) in seen:
                continue
        except (OSError, RuntimeError):  # a symbolic link loop (RuntimeError before Python 3.13)
            log.warning("models dir: %s left out: a symbolic link loop", path)
            continue
        paths.append(path)
    for path, out in zip(paths, describe_all(paths, timeout), strict=True):
        if isinstance(out, str):
            log.warning("models dir: %s left out: %s", path, out)
        elif out.name in cards:  # the default's .gguf itself, or another file of the same name
            log.info("models dir: %s left out: the name %r is %s's", path, out.name, cards[out.name].path)
        else:
            beside = projector_for(path, projectors) if path.suffix == ".gguf" and out.projector is None else None
            cards[out.name] = out if beside is None else dataclasses.replace(
                out, projector=beside, size_bytes=out.size_bytes + beside.stat().st_size)
    return cards
