"""Sampling settings, torch-free: one validated dataclass and the rules for its values, shared by the websocket
(webchat.serve.protocol), the API (webchat.serve.openai.schema) and the engine's sampler (webchat.engine.sampling)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_ALTS = 20


class SettingsError(ValueError):
    """A sampling setting out of range; names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        super().__init__(f"{field} must be {allowed}, got {value!r}")
        self.field = field
        self.value = value
        self.allowed = allowed


def _number(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False, integer: bool = False) -> None:
    kind = "an integer" if integer else "a number"
    allowed = f"{kind} in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type:
        raise SettingsError(name, value, allowed)
    v = float(value)  # type: ignore[arg-type]
    if math.isnan(v) or v > hi or v < lo or (lo_open and v == lo):
        raise SettingsError(name, value, allowed)


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
        _number("temperature", self.temperature, 0.0, 5.0)
        _number("top_k", self.top_k, 0, 100_000, integer=True)
        _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("typical_p", self.typical_p, 0.0, 1.0, lo_open=True)
        _number("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True)
        _number("repetition_range", self.repetition_range, 0, 1_000_000, integer=True)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if not isinstance(self.token_bias, dict):
            raise SettingsError("token_bias", self.token_bias, "a mapping of token id to bias")
        for tid, bias in self.token_bias.items():
            _number("token_bias key", tid, 0, 10_000_000, integer=True)
            _number(f"token_bias[{tid}]", bias, -100.0, 100.0)
        if self.seed is not None:
            _number("seed", self.seed, 0, 2**63 - 1, integer=True)

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
