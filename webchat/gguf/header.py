"""A GGUF file's header, metadata and tensor table, read with limits: no count or length is trusted before the bytes it
claims are known to be in the file, so a 133-byte file that declares 2^60 items is refused at once, by name.

    file   = "GGUF" | version u32 (2, 3) | n_tensors u64 | n_kv u64 | kv * n_kv | tensor * n_tensors | pad | data
    kv     = key: string | type u32 | value            string = n u64 | n bytes
    array  = item type u32 | n u64 | n items           an array of n items of at least s bytes needs n*s bytes left
    tensor = name: string | n_dims u32 | ne u64 * n_dims | ggml type u32 | offset u64 (from the aligned data start)

Beyond the bytes left: the header's total size, the strings in its arrays (what gguf's GGUFReader spends ~800 bytes
and 20 µs on, each), the tensors and the time are capped (`Limits`). Every tensor's data must lie inside the file.
Arrays are validated and skipped unless `keep(key, n)` asks for their items. Errors are one GGUFError each, naming
the file and what is wrong in words.
"""

from __future__ import annotations

import mmap
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
STRING, ARRAY, BOOL = 8, 9, 7
# GGUF value type -> struct code of one item (STRING and ARRAY are read apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
TYPE_NAMES = {t.value: t.name.lower() for t in gguf.GGUFValueType}
MIB = 1 << 20


class GGUFError(ValueError):
    """A .gguf that cannot be read: the message names the file and says what is wrong."""


@dataclass(frozen=True)
class Limits:
    header_bytes: int = 64 * MIB  # metadata and tensor table; a real model's are 1-10 MiB (most of it the vocabulary)
    strings: int = 1 << 20  # string items over all arrays; a vocabulary and its merges are at most ~500k
    tensors: int = 1 << 16  # a real model has at most a few thousand
    name_bytes: int = 1 << 16  # one key or tensor name
    seconds: float = 10.0  # reading the whole header


LIMITS = Limits()


@dataclass(frozen=True)
class Skipped:
    """An array that was checked but not read: its item type and count."""

    item_type: str
    count: int


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (the contiguous axis) first
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return gguf.GGMLQuantizationType(self.ggml_type).name.lower()


@dataclass
class Header:
    path: Path
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0


def keep_none(key: str, count: int) -> bool:
    return False


def keep_small(key: str, count: int) -> bool:
    """Small arrays outside the vocabulary (a per-layer head count, a window pattern): what describing a model reads."""
    return count <= 4096 and not key.startswith("tokenizer.")


class _Reader:
    def __init__(self, path: Path, buf: mmap.mmap | bytes, limits: Limits, keep: Callable[[str, int], bool]) -> None:
        self.path, self.buf, self.limits, self.keep = path, buf, limits, keep
        self.size = len(buf)
        self.pos = 0
        self.order = "<"
        self.strings = 0
        self.deadline = time.monotonic() + limits.seconds
        self.where = "the header"

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path.name}: {what}")

    def need(self, n: int, what: str) -> None:
        """n bytes must be left in the file, and in the header's budget."""
        left = self.size - self.pos
        if n > left:
            raise self.fail(f"{what} needs {n} bytes at byte {self.pos}, but the file ends {left} bytes later "
                            f"(in {self.where}): the file is truncated or its header is corrupt")
        if self.pos + n > self.limits.header_bytes:
            raise self.fail(f"its header is over {self.limits.header_bytes // MIB} MiB (at {self.where}); a model's "
                            "is a few MiB")

    def clock(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.fail(f"reading its header took more than {self.limits.seconds:g} s (in {self.where})")

    def unpack(self, code: str, what: str) -> Any:
        fmt = self.order + code
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.unpack("Q", f"the length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long; at most {limit} are allowed")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, key: str, vtype: int, keep: Callable[[str, int], bool]) -> Any:
        if vtype in SCALARS:
            return self.unpack(SCALARS[vtype], f"the value of {key!r}")
        if vtype == STRING:
            return self.string(f"the string value of {key!r}")
        if vtype != ARRAY:
            raise self.fail(f"key {key!r} has value type {vtype}, which is not a GGUF type (0 to 12)")
        item = self.unpack("I", f"the item type of array {key!r}")
        count = self.unpack("Q", f"the length of array {key!r}")
        return self.array(key, item, count, keep(key, count))

    def array(self, key: str, item: int, count: int, kept: bool) -> Any:
        if item == ARRAY:
            raise self.fail(f"key {key!r} is an array of arrays, which GGUF models do not use")
        if item not in SCALARS and item != STRING:
            raise self.fail(f"array {key!r} has item type {item}, which is not a GGUF type (0 to 12)")
        width = 8 if item == STRING else struct.calcsize(SCALARS[item])  # a string is at least its length
        left = self.size - self.pos
        if count * width > left:
            raise self.fail(f"key {key!r} declares an array of {count} {TYPE_NAMES.get(item, item)} items, which "
                            f"needs at least {count * width} bytes; only {left} bytes are left in the file")
        self.need(count * width, f"array {key!r}")
        if item != STRING:
            start, self.pos = self.pos, self.pos + count * width
            if not kept:
                return Skipped(TYPE_NAMES[item], count)
            return list(struct.unpack_from(f"{self.order}{count}{SCALARS[item]}", self.buf, start))
        if self.strings + count > self.limits.strings:
            raise self.fail(f"its metadata holds more than {self.limits.strings} strings in arrays ({count} in "
                            f"{key!r}); a model's vocabulary and merges are at most a few hundred thousand")
        self.strings += count
        return self.string_array(key, count, kept)

    def string_array(self, key: str, count: int, kept: bool) -> Any:
        out: list[str] = []
        fmt, buf, end = self.order + "Q", self.buf, min(self.size, self.limits.header_bytes)
        for i in range(count):
            if i & 0xFFFF == 0xFFFF:
                self.clock()
            if self.pos + 8 > end:
                self.need(8, f"the length of string {i} of {key!r}")
            (n,) = struct.unpack_from(fmt, buf, self.pos)
            self.pos += 8
            if self.pos + n > end:
                self.need(n, f"string {i} of {key!r}")
            if kept:
                out.append(bytes(buf[self.pos:self.pos + n]).decode("utf-8", errors="replace"))
            self.pos += n
        return out if kept else Skipped("string", count)


def read_header(path: Path, keep: Callable[[str, int], bool] = keep_small, limits: Limits = LIMITS) -> Header:
    """The header of the GGUF at `path`, every count checked before it is used; GGUFError (one line) otherwise.
    Arrays for which keep(key, count) is False come back as `Skipped`."""
    path = Path(path)
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the open, a device never end
            raise GGUFError(f"{path.name}: not a regular file")
        with path.open("rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise GGUFError(f"{path.name}: {size} bytes long, too short for a GGUF header (24 bytes at least)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _read(_Reader(path, buf, limits, keep))
    except OSError as exc:
        raise GGUFError(f"{path.name}: cannot be read: {os_words(exc)}") from None


def _read(r: _Reader) -> Header:
    magic = bytes(r.buf[:4])
    if magic != MAGIC:
        raise r.fail(f"not a GGUF file (it starts with {magic!r}, a GGUF file with {MAGIC!r})")
    r.pos = 4
    version = r.unpack("I", "the version")
    if version & 0xFFFF == 0:  # written on a big-endian machine
        r.order = ">"
        version = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in VERSIONS:
        raise r.fail(f"GGUF version {version} is not one webchat reads ({' or '.join(map(str, VERSIONS))})")
    n_tensors, n_kv = r.unpack("Q", "the tensor count"), r.unpack("Q", "the key count")
    if n_tensors > r.limits.tensors:
        raise r.fail(f"its header declares {n_tensors} tensors; at most {r.limits.tensors} are read")
    if n_kv * 13 > r.size - r.pos:  # a key is at least its length (8), a type (4) and one byte
        raise r.fail(f"its header declares {n_kv} metadata keys, which need at least {n_kv * 13} bytes; the file "
                     f"has {r.size - r.pos} bytes left")
    header = Header(r.path, version)
    for i in range(n_kv):
        r.clock()
        r.where = f"metadata key {i} of {n_kv}"
        key = r.string(f"the name of metadata key {i}", r.limits.name_bytes)
        r.where = f"metadata key {key!r}"
        header.metadata[key] = r.value(key, r.unpack("I", f"the value type of {key!r}"), r.keep)
    header.tensors = _tensors(r, n_tensors)
    alignment = header.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise r.fail(f"general.alignment is {alignment!r}; expected a power of two")
    header.data_start = -(-r.pos // alignment) * alignment
    for t in header.tensors:
        _place(r, t, header.data_start, alignment)
    return header


def _tensors(r: _Reader, count: int) -> list[TensorInfo]:
    out: list[TensorInfo] = []
    seen: set[str] = set()
    for i in range(count):
        r.clock()
        r.where = f"tensor {i} of {count}"
        name = r.string(f"the name of tensor {i}", r.limits.name_bytes)
        if name in seen:
            raise r.fail(f"tensor {name!r} is listed twice")
        seen.add(name)
        r.where = f"tensor {name!r}"
        n_dims = r.unpack("I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
        shape = tuple(r.unpack("Q", f"dimension {d} of tensor {name!r}") for d in range(n_dims))
        kind = r.unpack("I", f"the type of tensor {name!r}")
        offset = r.unpack("Q", f"the data offset of tensor {name!r}")
        out.append(TensorInfo(name, shape, kind, offset, 0))
    return out


def _place(r: _Reader, t: TensorInfo, data_start: int, alignment: int) -> None:
    """Check the tensor's type, shape and data range against the file; set its absolute offset and size."""
    try:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
    except (ValueError, KeyError):
        raise r.fail(f"tensor {t.name!r} has ggml type {t.ggml_type}, which is not a type gguf knows") from None
    elements = 1
    for n in t.shape:
        elements *= n
    if elements >= 1 << 62:
        raise r.fail(f"tensor {t.name!r} has shape {list(t.shape)}: {elements} elements is not a real tensor")
    if t.shape[0] % block:
        raise r.fail(f"tensor {t.name!r} has rows of {t.shape[0]} values, not a multiple of its "
                     f"{gguf.GGMLQuantizationType(t.ggml_type).name} block of {block}")
    if t.offset % alignment:
        raise r.fail(f"tensor {t.name!r} starts at data offset {t.offset}, not a multiple of the alignment "
                     f"{alignment}")
    t.nbytes = elements // block * type_size
    t.offset += data_start
    if t.offset + t.nbytes > r.size:
        raise r.fail(f"tensor {t.name!r} needs bytes {t.offset} to {t.offset + t.nbytes}, but the file ends at byte "
                     f"{r.size}: the file is truncated")


def os_words(exc: OSError) -> str:
    """An OSError said plainly: a symbolic link loop, a broken link, no permission, ..."""
    import errno

    words = {errno.ELOOP: "a symbolic link loop", errno.ENOENT: "it does not exist (a broken symbolic link?)",
             errno.EACCES: "permission denied", errno.EISDIR: "it is a folder", errno.EIO: "an I/O error",
             errno.ENAMETOOLONG: "its name is too long", errno.ENODEV: "it cannot be mapped (not a regular file)"}
    return words.get(exc.errno or 0, exc.strerror or str(exc))
