"""Sampling settings, torch-free: one validated dataclass and the rules for its values, shared by the websocket
(webchat.serve.protocol), the API (webchat.serve.openai.schema) and the engine's sampler (webchat.engine.sampling)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_TOP_ALTS = 20


class SettingsError(ValueError):
    """A sampling setting out of range; names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        super().__init__(f"{field} must be {allowed}, got {value!r}")
        self.field = field
        self.value = value
        self.allowed = allowed


@dataclass(frozen=True)
class Range:
    """The values one numeric setting allows: [lo, hi], or (lo, hi] when lo_open. The websocket's schema declares its
    fields from the same table (webchat.serve.protocol.WireSettings), so the two cannot drift apart."""

    lo: float
    hi: float
    lo_open: bool = False
    integer: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        return f"{kind} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"

    def check(self, name: str, value: object) -> None:
        ok_type = isinstance(value, int) if self.integer else isinstance(value, int | float)
        if isinstance(value, bool) or not ok_type:
            raise SettingsError(name, value, self.describe())
        v = float(value)  # type: ignore[arg-type]
        if math.isnan(v) or v > self.hi or v < self.lo or (self.lo_open and v == self.lo):
            raise SettingsError(name, value, self.describe())


RANGES: dict[str, Range] = {
    "temperature": Range(0.0, 5.0),
    "top_k": Range(0, 100_000, integer=True),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "min_p": Range(0.0, 1.0),
    "typical_p": Range(0.0, 1.0, lo_open=True),
    "repetition_penalty": Range(0.0, 10.0, lo_open=True),
    "repetition_range": Range(0, 1_000_000, integer=True),
    "frequency_penalty": Range(-2.0, 2.0),
    "presence_penalty": Range(-2.0, 2.0),
    "seed": Range(0, 2**63 - 1, integer=True),
}
BIAS_RANGE = Range(-100.0, 100.0)  # each token_bias value
TOKEN_ID_RANGE = Range(0, 10_000_000, integer=True)  # a token_bias key, before the vocabulary is known


@dataclass(frozen=True)
class SamplingSettings:
    """How to pick each token; validated once at construction (SettingsError names field, value and range).

    Order applied to a logits row: token bias, repetition penalty, frequency/presence penalties, then
    temperature (0 = greedy argmax), top-k, top-p, min-p, typical-p, renormalise, draw.
    The penalties look at the last `repetition_range` tokens of the whole sequence (prompt + reply; 0 = all).
    """

    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    repetition_range: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    token_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if value is not None or name != "seed":  # seed None: no seed
                allowed.check(name, value)
        if not isinstance(self.token_bias, dict):
            raise SettingsError("token_bias", self.token_bias, "a mapping of token id to bias")
        for tid, bias in self.token_bias.items():
            TOKEN_ID_RANGE.check("token_bias key", tid)
            BIAS_RANGE.check(f"token_bias[{tid}]", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


MAX_TOKEN_ID_DIGITS = 9  # a vocabulary has far fewer than 10^9 entries; longer keys are refused before int()


def token_id(key: object, vocab_size: int | None = None, name: str = "token_bias key") -> int:
    """A token id written as a JSON object key: ASCII decimal digits only (str.isdigit() also takes "²" and "٣", which
    int() refuses or reads as 3), at most MAX_TOKEN_ID_DIGITS of them, inside the vocabulary when it is known."""
    allowed = "a token id written in ASCII digits" + (f", in [0, {vocab_size - 1}]" if vocab_size else "")
    if not isinstance(key, str) or not 0 < len(key) <= MAX_TOKEN_ID_DIGITS or not key.isascii() or not key.isdigit():
        shown = key if not isinstance(key, str) or len(key) <= 40 else key[:40] + f"… ({len(key)} characters)"
        raise SettingsError(name, shown, allowed)
    tid = int(key)
    if vocab_size is not None and tid >= vocab_size:
        raise SettingsError(name, key, allowed)
    return tid


def check_token_ids(ids: Iterable[int], vocab_size: int, name: str) -> None:
    """Every id inside the vocabulary (a bias's keys, a prompt of ids): SettingsError naming the first that is not."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SettingsError(name, bad, f"a token id in [0, {vocab_size - 1}]")
