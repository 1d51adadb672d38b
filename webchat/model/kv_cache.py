"""The paged KV cache: one pool of fixed-size pages per layer, ref-counted, hashed so identical prefixes are shared.

    pool.k[layer], pool.v[layer]: (num_pages, page_size, n_kv, hd), or a q8_0 row's bytes (webchat.model.kv_format),
    on the CPU laid head-major (each head's slots together: strides, not the shape, say so);
    token p of a sequence lives in slot table.pages[p // page_size] * page_size + p % page_size
    (webchat.model.batch). Page 0 is never handed out.

A page whose page_size tokens are all computed is registered under (parent id, its tokens), parent id naming the
registered page before it, so a lookup walks a prompt page by page and only an identical prefix matches (vLLM's
prefix caching, exllamav2's hashed pages). A sequence's last, partly filled page is registered too when it is
released (`PageTable.release(tokens)`), with the tokens its first slots hold: `lookup_tail` then finds, among the
pages chained after a prefix, the one sharing the most next tokens, and the caller copies it (its slots past the
match are rewritten), so a repeated or extended prompt reuses its cache to the token, as llama-server's slots do.
Released pages (ref 0) keep their k/v and registration on the free list, oldest first, until they are handed out
again; `evict` lets the owner release an idle session's pages under pressure.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from webchat.model import kv_format
from webchat.model.arena import empty_on_huge_pages
from webchat.model.batch import Batch, make_batch
from webchat.model.config import ModelArgs

PAGE_SIZE = 16
ROOT = 0  # the parent id of a sequence's first page


class PoolExhausted(RuntimeError):
    """No free page and nothing idle to evict (the caller admitted more than the pool holds)."""


def kv_bytes_per_token(args: ModelArgs, dtype: torch.dtype, kind: str | None = None) -> int:
    """k and v of every layer: 2 * n_layers * n_kv * a head row's bytes (hd * element size, or kind's)."""
    row = kv_format.row_bytes(kind, args.head_dim) if kind is not None else \
        args.head_dim * torch.empty((), dtype=dtype).element_size()
    return 2 * args.n_layers * args.n_kv_heads * row


def _head_major(whole: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """(layers, pages, page_size, n_kv, row) laid (layers, n_kv, pages, page_size, row): each head's slots one run.
    In a mapping of its own (zero-filled as first touched) on 4 KiB pages, not huge ones: a head's run starts in a
    2 MiB page of its own, so a pool's first token would make one resident for every layer, head, k and v (the default
    model: 360 MiB; an 8B's 8,192 tokens: 1 GiB), where on 4 KiB pages a pool is resident as it is written. The
    decode 7,472 deep ran 62-67 tok/s so, 67-71 on huge pages."""
    layers, pages, page_size, n_kv, row = whole
    return empty_on_huge_pages((layers, n_kv, pages, page_size, row), dtype, huge=False).permute(0, 2, 3, 1, 4)


class KVPool:
    """num_pages pages of page_size token slots per layer; page 0 is the padding page."""

    def __init__(self, args: ModelArgs, num_pages: int, device: torch.device | str, dtype: torch.dtype,
                 page_size: int = PAGE_SIZE, kind: str | None = None, head_major: bool | None = None) -> None:
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"a pool needs at least 2 pages of at least 1 slot, got {num_pages} of {page_size}")
        # kind (webchat.model.kv_format): rows stored as f32, f16 or q8_0 bytes; None: in `dtype` as computed
        row = args.head_dim
        if kind is not None:
            dtype, row = kv_format.storage(kind, args.head_dim)
        shape = (num_pages, page_size, args.n_kv_heads, row)
        # Every layer's k (and v) in one tensor, pool.k[layer] a view of it: a page's copy is one op for all layers.
        # empty: a page costs resident memory once written. The free list hands out never-written pages before
        # released ones (those keep their k/v for prefix reuse, least recently used first), so over a server's life
        # RSS grows to the pool's size (--kv-pool), as llama-server holds its whole KV cache from the start. A slot is
        # always written before it is read, except the padding page 0 (masked rows read it), zeroed so it holds no NaN.
        # On the CPU head_major (the default there; the CUDA kernels, emulated on the CPU too, take slot-major pools,
        # those in a huge-page-advised mapping, webchat.model.arena): each head's slots together, (layers, n_kv, pages,
        # page_size, row) in memory seen as the shape above. A decode row's attention then reads a kv head's keys and
        # values as one run from page to page; slot-major (a head's row, then the other heads') a decode step 7,472
        # tokens deep took 1.34x as long (Zen 4, docs/perf-history.md).
        whole = (args.n_layers, *shape)
        cpu = torch.device(device).type == "cpu"
        if head_major is None:
            head_major = cpu

        def make() -> torch.Tensor:
            if not cpu:
                return torch.empty(whole, device=device, dtype=dtype)
            return _head_major(whole, dtype) if head_major else empty_on_huge_pages(whole, dtype)

        self._k, self._v = make(), make()
        self.k, self.v = list(self._k.unbind(0)), list(self._v.unbind(0))
        self._k[:, 0].zero_()
        self._v[:, 0].zero_()
        self.page_size, self.num_pages = page_size, num_pages
        self.page_bytes = page_size * kv_bytes_per_token(args, dtype, kind)
        self.kind = kv_format.kind_name(dtype)  # what /api/info reports: the tensors' dtype says
        self.ref = [0] * num_pages
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))  # oldest first
        self.ids: dict[int, int] = {}  # registered page -> its id (unique for the pool's life; parent of the next)
        self.keys: dict[int, tuple[int, tuple[int, ...]]] = {}  # registered page -> (parent id, tokens)
        self.by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self.partial: dict[int, tuple[int, tuple[int, ...]]] = {}  # free page -> (parent id, the tokens it holds)
        self.children: dict[int, set[int]] = {}  # parent id -> registered pages (whole or partial) chained after it
        self._next_id = ROOT + 1
        self.evict: Callable[[], bool] | None = None  # releases one idle holder's pages; False when none is left

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def used_pages(self) -> int:
        """Pages some sequence or session holds (ref > 0)."""
        return self.usable_pages - len(self.free)

    def alloc(self) -> int:
        """A fresh page (ref 1), evicting idle holders while none is free."""
        while not self.free:
            if self.evict is None or not self.evict():
                raise PoolExhausted(f"all {self.usable_pages} KV pages are in use and none is idle")
        page, _ = self.free.popitem(last=False)
        self._unregister(page)
        self.ref[page] = 1
        return page

    def hold(self, page: int) -> None:
        if self.ref[page] == 0:
            del self.free[page]
        self.ref[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            assert self.ref[page] > 0, f"page {page} released more often than held"
            self.ref[page] -= 1
            if self.ref[page] == 0:
                self.free[page] = None

    def copy(self, src: int) -> int:
        """A new page holding src's k/v (copy on write of a shared page)."""
        dst = self.alloc()
        self._k[:, dst].copy_(self._k[:, src])  # 0.08 ms for the default model (60 per-layer copies: 0.28)
        self._v[:, dst].copy_(self._v[:, src])
        return dst

    def lookup(self, tokens: list[int]) -> list[int]:
        """Registered pages holding tokens' longest prefix of whole pages (not held: call hold())."""
        pages: list[int] = []
        parent, ps = ROOT, self.page_size
        for i in range(len(tokens) // ps):
            page = self.by_key.get((parent, tuple(tokens[i * ps : (i + 1) * ps])))
            if page is None:
                break
            pages.append(page)
            parent = self.ids[page]
        return pages

    def register(self, page: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Record a full page's tokens; returns the id the next page chains from."""
        if page in self.ids:
            return self.ids[page]
        key = (parent, tokens)
        twin = self.by_key.get(key)
        if twin is not None:  # the same prefix already computed in another page: chain through that one
            return self.ids[twin]
        if page in self.partial:
            self._unregister(page)
        self.ids[page], self.keys[page], self.by_key[key] = self._next_id, key, page
        self.children.setdefault(parent, set()).add(page)
        self._next_id += 1
        return self.ids[page]

    def register_partial(self, page: int, parent: int, tokens: tuple[int, ...]) -> None:
        """A released page whose first len(tokens) slots hold these tokens' k/v, after the prefix `parent` names."""
        if self.ref[page] or page in self.keys or not 0 < len(tokens) < self.page_size:
            return
        self.partial[page] = (parent, tokens)
        self.children.setdefault(parent, set()).add(page)

    def lookup_tail(self, parent: int, tokens: list[int]) -> tuple[int, int]:
        """(page, n): the registered page after `parent` whose first n slots hold tokens[:n], n largest (0: none)."""
        best, best_n = 0, 0
        for page in self.children.get(parent, ()):
            held = self.keys[page][1] if page in self.keys else self.partial[page][1]
            n = 0
            for a, b in zip(held, tokens, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = page, n
        return best, best_n

    def copy_prefix(self, src: int) -> int:
        """A new private page holding src's k/v (src may be free: it is held while copied, so alloc cannot take it)."""
        self.hold(src)
        try:
            return self.copy(src)
        finally:
            self.release([src])

    def forget(self) -> None:
        """Drop the registrations of free pages: the next lookups find only prefixes held now (cold starts)."""
        for page in list(self.free):
            self._unregister(page)

    def _unregister(self, page: int) -> None:
        key = self.keys.pop(page, None)
        if key is not None:
            del self.by_key[key]
            del self.ids[page]
        else:
            key = self.partial.pop(page, None)
        if key is not None:
            siblings = self.children.get(key[0])
            if siblings is not None:
                siblings.discard(page)
                if not siblings:
                    del self.children[key[0]]


class PageTable:
    """One sequence's pages and the registration chain of its full pages."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.pages: list[int] = []
        self.chain: list[int] = []  # ids of the registered prefix: chain[i] for pages[i]

    def adopt(self, pages: list[int]) -> None:
        """Start from shared pages (a lookup's result), holding each."""
        assert not self.pages
        for page in pages:
            self.pool.hold(page)
        self.pages = list(pages)

    def ensure(self, n_tokens: int) -> None:
        """Enough pages for positions [0, n_tokens)."""
        while len(self.pages) * self.pool.page_size < n_tokens:
            self.pages.append(self.pool.alloc())

    def truncate(self, n: int) -> None:
        """Positions >= n will be rewritten: drop pages past them, make the page holding n private and unregistered."""
        ps, pool = self.pool.page_size, self.pool
        keep = -(-n // ps)
        pool.release(self.pages[keep:])
        del self.pages[keep:]
        del self.chain[n // ps :]
        if n % ps:
            i = n // ps
            page = self.pages[i]
            if pool.ref[page] > 1:
                self.pages[i] = pool.copy(page)
                pool.release([page])
            else:
                pool._unregister(page)

    def register(self, tokens: list[int], n_valid: int) -> None:
        """Register every full page within the first n_valid tokens (their k/v are computed)."""
        ps = self.pool.page_size
        for i in range(len(self.chain), n_valid // ps):
            parent = self.chain[-1] if self.chain else ROOT
            self.chain.append(self.pool.register(self.pages[i], parent, tuple(tokens[i * ps : (i + 1) * ps])))

    def release(self, tokens: list[int] | None = None) -> None:
        """Give every page back; with `tokens` (those whose k/v the pages hold, in order) a last, partly filled page is
        registered for lookup_tail once nobody holds it."""
        pool, ps = self.pool, self.pool.page_size
        pool.release(self.pages)
        if tokens is not None and len(tokens) % ps and len(self.pages) == -(-len(tokens) // ps):
            whole = len(tokens) // ps
            if len(self.chain) == whole:
                parent = self.chain[-1] if self.chain else ROOT
                pool.register_partial(self.pages[whole], parent, tuple(tokens[whole * ps :]))
        self.pages, self.chain = [], []


class SeqCache:
    """One sequence on a pool of its own: the single-stream path (tests, the CLIs, a draft model's drafts)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.table = PageTable(pool)
        self.ids: list[int] = []  # tokens whose k/v are in the pool, positions 0..length-1

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def capacity(self) -> int:
        return self.pool.usable_pages * self.pool.page_size

    def feed(self, model: Callable[[Batch, KVPool], torch.Tensor], ids: list[int],
             all_logits: bool = False) -> torch.Tensor:
        """Run ids at positions length..; logits (len(ids) or 1, vocab) float32."""
        start, t = self.length, len(ids)
        if start + t > self.capacity:
            raise ValueError(f"{t} tokens at position {start} overflow the cache of {self.capacity}")
        self.table.ensure(start + t)
        rows = list(range(t)) if all_logits else [-1]
        batch = make_batch([(ids, start, self.table.pages, rows)], self.pool.page_size, self.pool.k[0].device)
        logits = model(batch, self.pool)
        self.ids.extend(ids)
        return logits

    def truncate(self, n: int) -> None:
        """Rewind to n valid positions (rejected drafts, a new turn sharing a prefix)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.table.truncate(n)
        del self.ids[n:]


CPU_POOL_BYTES = 1 << 30  # default KV pool on the CPU: 1 GiB (untouched pages cost no resident memory)
GPU_POOL_FRACTION = 0.5  # default on a GPU: half the memory free after loading the model


def size_bytes(text: str) -> int | None:
    """"512MiB", "2 GiB", "1.5GiB" as bytes; None when it is not a positive size in MiB or GiB."""
    value = text.strip().replace(" ", "")
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if value.endswith(unit):
            try:
                n = float(value[: -len(unit)])
            except ValueError:
                return None
            return int(n * scale) if n > 0 else None
    return None


def pool_spec(spec: str) -> tuple[int | None, int | None]:
    """(bytes, tokens) a pool size names: "512MiB" -> (bytes, None), "3000" -> (None, 3000); (None, None) if neither."""
    nbytes = size_bytes(spec)
    if nbytes is not None:
        return nbytes, None
    text = spec.strip().replace(" ", "")
    return None, int(text) if text.isdigit() and int(text) > 0 else None


def pool_tokens(spec: str | None, args: ModelArgs, dtype: torch.dtype, device: torch.device | str,
                kind: str | None = None) -> int:
    """Token slots of a pool sized by `spec`: "N" tokens, "N MiB"/"NMiB"/"N GiB", or None for the device default;
    kind: how the pool stores a row (webchat.model.kv_format), None: in `dtype`."""
    per_token = kv_bytes_per_token(args, dtype, kind)
    if spec is None:
        dev = torch.device(device)
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            return max(1, int(free * GPU_POOL_FRACTION) // per_token)
        return max(1, CPU_POOL_BYTES // per_token)
    nbytes, tokens = pool_spec(spec)
    if nbytes is not None:
        return max(1, nbytes // per_token)
    if tokens is not None:
        return tokens
    raise ValueError(f"KV pool size must be a positive token count or a size like 512MiB or 2GiB, got {spec!r}")
