"""A CPU model's weights moved into one anonymous mapping advised for transparent huge pages, and the KV pool made in
one of its own.

Decode streams every weight once a token. On 4 KiB pages a 1.1B Q4_1 model's 640 MB is 160,000 pages, far past what
the TLB holds, so the forward walks page tables all the time; on 2 MiB pages it is 320 of them. Linux gives a mapping
huge pages where it is advised (`MADV_HUGEPAGE`; the distributions' default `transparent_hugepage=madvise` gives none
otherwise), private and anonymous (torch's own allocations are neither advised nor 2 MiB-aligned). llama.cpp maps the
GGUF file instead, and page-cache pages are 4 KiB on the usual filesystems.

    moved = into_huge_pages(model, leave=[model.tok_embeddings.weight])   # bytes moved; 0 without MADV_HUGEPAGE

An embedding table that is not also the head is left where it is: the forward gathers its rows, never streams it, and
in place only the rows of tokens seen become resident (a 1.1B model's table is 41 MB of Q4_1 blocks).

Loaded tensors are mostly views of the checkpoint's file mapping, which stays mapped while any of them lives; so each
tensor's file pages are dropped from the mapping as soon as it is copied (`MADV_DONTNEED`), and loading peaks at the
weights plus a page or two a tensor, not twice the weights. Only pages no other tensor still in use overlaps are
dropped: the mapping is private and writable, and a page changed in place would read back as the file's bytes.
Tensors shared between modules (tied embeddings) move once and stay shared.
The values are the same bytes: only where they live changes. Without THP (`never`, or not Linux) the mapping is plain
4 KiB pages and nothing is lost but the copy.

    k = empty_on_huge_pages((layers, pages, 16, n_kv, hd), torch.float32)   # a slot-major KVPool (CUDA's)

The KV pool is the other thing a step reads across: a prompt's attention 6,000 tokens deep walks every layer's keys
and values, 9 MB of the default model's on 2,200 pages of 4 KiB a layer, and under a hypervisor's nested paging each
TLB miss is a walk of two page tables. A slot-major pool (the CUDA kernels', emulated on the CPU) is made here: advised
before anything is written, its 2 MiB regions become resident whole as they are first written (the default model's
first token: 2 MiB for each layer's k and v), and it reads as 2 MiB pages. The CPU's own pools are head-major, each
head's slots one run read in order, and stay on 4 KiB pages (webchat.model.kv_cache._head_major: a huge page a head's
run would make 360 MiB of the default model's pool resident at its first token; in order, the reads lose ~6% to the
small pages).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

HUGE = 2 << 20  # the x86-64 and arm64 (4 KiB granule) PMD size
PAGE = 4096  # a matrix starts on its own page
SMALL = 64 << 10  # under this (norms, biases) a tensor starts on a cache line


def _align(nbytes: int) -> int:
    return PAGE if nbytes >= SMALL else 64


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _file_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's file-backed mappings (empty where /proc/self/maps is not there)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            lo, hi = fields[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _drop_file_pages(span: tuple[int, int], files: list[tuple[int, int]], needed: list[tuple[int, int]]) -> None:
    """Unmap the whole pages of a copied tensor's span where they lie in a file mapping and no tensor still in use
    overlaps them: they leave this process's RSS. The mapping is private and writable, so a page changed in place
    would lose the change; hence the overlap check, so that no one reads these bytes again."""
    ptr, end = span
    lo, hi = _round(ptr, PAGE), end // PAGE * PAGE
    if hi <= lo or not any(start <= ptr and end <= stop for start, stop in files):
        return
    if any(a < hi and lo < b for a, b in needed):
        return
    _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


def _advised_area(size: int, huge: bool = True) -> tuple[torch.Tensor, int] | None:
    """(bytes of a private anonymous mapping of size + 2 MiB, the offset of its first 2 MiB boundary), advised for huge
    pages from there (unless not huge: 4 KiB pages); None where the platform lacks such mappings or MADV_HUGEPAGE."""
    advise: int | None = getattr(mmap, "MADV_HUGEPAGE", None)
    private: int | None = getattr(mmap, "MAP_PRIVATE", None)
    anonymous: int | None = getattr(mmap, "MAP_ANONYMOUS", None)
    if advise is None or private is None or anonymous is None:
        return None
    size = _round(size, HUGE) + HUGE  # room to start on a 2 MiB boundary
    try:  # private: a shared anonymous mapping is shmem, no THP
        area = mmap.mmap(-1, size, flags=private | anonymous)
    except OSError as e:  # what torch.empty raises where the memory is not there, with the size asked for
        raise RuntimeError(f"cannot map {size / 2**20:.0f} MiB of memory: {e.strerror or e}") from e
    whole = torch.frombuffer(area, dtype=torch.uint8)  # holds the mapping alive as long as any view of it
    offset = -whole.data_ptr() % HUGE
    try:
        if huge:
            area.madvise(advise, offset, size - offset)
    except OSError:  # THP compiled out: plain pages still hold the bytes
        pass
    return whole, offset


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """An uninitialized CPU tensor from the start of its own huge-page-advised mapping (huge=False: one on 4 KiB pages;
    its pages resident only once written: the mapping is zero-filled on demand); torch.empty where the platform has no
    such mapping."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    got = _advised_area(nbytes, huge) if nbytes > 0 else None
    if got is None:
        return torch.empty(shape, dtype=dtype)
    whole, offset = got
    return whole[offset:offset + nbytes].view(dtype).view(shape)


def into_huge_pages(model: nn.Module, leave: Iterable[torch.Tensor] = ()) -> int:
    """Move every CPU parameter of the model but those in `leave` into one huge-page-advised mapping; returns the
    bytes moved (0: nothing to move, or the platform lacks anonymous private mappings with MADV_HUGEPAGE). Small ones
    move too: the pages of a tensor that stays a view of the checkpoint's file mapping are resident once read."""
    kept = {id(p) for p in leave}
    params = [p for p in model.parameters()  # a shared one once
              if p.device.type == "cpu" and p.is_contiguous() and id(p) not in kept]
    if not params:
        return 0
    moving = {id(p) for p in params}
    spans = [_span(p) for p in params]
    total = sum(_round(end - ptr, _align(end - ptr)) for ptr, end in spans)
    got = _advised_area(total)
    if got is None:
        return 0
    whole, offset = got
    files = _file_mappings()
    staying = [_span(t) for t in model.buffers()] + [_span(p) for p in model.parameters() if id(p) not in moving]
    for i, p in enumerate(params):
        n = spans[i][1] - spans[i][0]
        dest = whole[offset:offset + n].view(p.dtype).view(p.shape)
        dest.copy_(p.data)
        _drop_file_pages(spans[i], files, staying + spans[i + 1:])
        p.data = dest  # the old storage goes as its last reference does
        offset += _round(n, _align(n))
    return total
