"""EmbeddingCache: least recently used out first, bounded in bytes, a value over the budget never kept."""

from __future__ import annotations

import pytest
import torch

from webchat.vision.cache import EmbeddingCache


def rows(n: int) -> torch.Tensor:
    return torch.zeros(n, 4)  # 16 bytes a row


def test_the_least_recently_used_goes_first_and_bytes_stay_bounded() -> None:
    cache = EmbeddingCache(max_bytes=160)
    cache.put("a", rows(4))
    cache.put("b", rows(4))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", rows(4))  # 192 bytes > 160: b goes
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.bytes == 128 and len(cache) == 2
    cache.put("a", rows(2))  # replaced: its old bytes given back
    assert cache.bytes == 96


def test_a_value_over_the_budget_is_not_kept() -> None:
    cache = EmbeddingCache(max_bytes=100)
    cache.put("big", rows(10))
    assert cache.get("big") is None and cache.bytes == 0
    with pytest.raises(ValueError, match="max_bytes must be at least 0; got -1"):
        EmbeddingCache(-1)
