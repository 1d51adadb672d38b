"""Image embeddings kept by content: an LRU bounded in bytes, so an image seen in an earlier turn is not encoded
again."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

DEFAULT_BYTES = 256 << 20  # 256 MiB: ~115 SmolVLM images of 5 tiles (320 x 576 floats), ~400 Gemma 3 images


class EmbeddingCache:
    """Embeddings (n_tokens, text_dim) by key, the least recently used dropped past `max_bytes`; thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0; got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: str, value: torch.Tensor) -> None:
        """Keep `value` (not copied: callers must not change it); one larger than the whole budget is not kept."""
        size = value.numel() * value.element_size()
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old.numel() * old.element_size()
            if size > self.max_bytes:
                return
            self._items[key] = value
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self.bytes -= dropped.numel() * dropped.element_size()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)
