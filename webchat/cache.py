"""A preallocated KV cache for one sequence, with an explicit length that can be rewound."""

from __future__ import annotations

import torch

from webchat.config import ModelArgs


class KVCache:
    """Per layer k and v of shape (n_kv_heads, capacity, head_dim); positions [0, length) are valid."""

    def __init__(self, args: ModelArgs, capacity: int, device: torch.device | str, dtype: torch.dtype) -> None:
        if capacity <= 0:
            raise ValueError(f"cache capacity must be positive, got {capacity}")
        shape = (args.n_kv_heads, capacity, args.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.capacity = capacity
        self.length = 0

    def truncate(self, n: int) -> None:
        """Rewind to n valid positions (rejected speculative tokens, a new turn sharing a prefix)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    def reset(self) -> None:
        self.length = 0

    def copy(self) -> KVCache:
        new = KVCache.__new__(KVCache)
        new.k = [t.clone() for t in self.k]
        new.v = [t.clone() for t in self.v]
        new.capacity, new.length = self.capacity, self.length
        return new

    @property
    def free(self) -> int:
        return self.capacity - self.length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
