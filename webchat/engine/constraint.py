"""What a sequence may say next: the per-sequence constraint the engine applies before sampling (a grammar), and the
token bitmask both speak (llguidance's and xgrammar's layout).

    constraint.mask(bits) -> bool     # fill the (ceil(vocab/32),) int32 bitmask; False: nothing is forbidden now
    constraint.forced() -> [ids]      # tokens that alone may come next (taken as verify rows: no forward of their own)
    constraint.accept(token)          # the engine emitted it (after every emitted token, in order)

The engine never imports a grammar library: a transport builds the constraint (a JSON schema, a regex, a tool call)
and puts it on the GenerationRequest. The state advances on emitted tokens only, so
a rejected draft needs no rollback; a branch or Continue builds a new constraint and replays the kept tokens.
Bit t of the mask is word t // 32, bit t % 32 (1 = allowed).
"""

from __future__ import annotations

from typing import Protocol

import torch


class ConstraintError(RuntimeError):
    """The constraint cannot go on (its grammar allows no token, or refused one it allowed): the request fails."""


class Constraint(Protocol):
    def mask(self, bits: torch.Tensor) -> bool:
        """Fill bits (int32, (ceil(vocab/32),), CPU) with the tokens allowed next; False (bits untouched): any token."""
        ...

    def forced(self) -> list[int]:
        """Tokens the constraint alone decides next, in order (empty when the model has a choice)."""
        ...

    def accept(self, token: int) -> None:
        """The engine emitted `token`; ConstraintError if the constraint did not allow it."""
        ...


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def empty_mask(vocab_size: int) -> torch.Tensor:
    return torch.zeros(mask_words(vocab_size), dtype=torch.int32)


def only(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """A mask allowing exactly `tokens`."""
    bits = empty_mask(vocab_size)
    for t in tokens:
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id must be in [0, {vocab_size - 1}], got {t}")
        word = int(bits[t // 32])
        word |= 1 << (t % 32)
        bits[t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 two's complement
    return bits


_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The mask as a (vocab,) bool row."""
    return ((bits.reshape(-1, 1) >> _SHIFTS) & 1).reshape(-1)[:vocab_size].bool()


def allows(bits: torch.Tensor, token: int) -> bool:
    return bool((int(bits[token // 32]) >> (token % 32)) & 1)


def apply(row: torch.Tensor, bits: torch.Tensor) -> None:
    """Forbidden logits of a (vocab,) row set to -inf, in place."""
    row.masked_fill_(~allowed(bits, row.shape[-1]), float("-inf"))

