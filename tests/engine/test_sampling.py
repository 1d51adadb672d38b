"""Sampling settings validation and the sampler's maths."""

from __future__ import annotations

import math

import pytest
import torch

from webchat.engine.sampling import RowAsk, Sampler, sample_batch
from webchat.engine.settings import SamplingSettings, SettingsError, token_id

PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", -0.1, "[0, 5]"),
        ("temperature", float("nan"), "[0, 5]"),
        ("top_k", -1, "[0, 100000]"),
        ("top_k", 2.5, "an integer"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("min_p", 1.01, "[0, 1]"),
        ("typical_p", 0.0, "(0, 1]"),
        ("repetition_penalty", 0.0, "(0, 10]"),
        ("repetition_range", -5, "[0, 1e+06]"),
        ("frequency_penalty", 2.5, "[-2, 2]"),
        ("presence_penalty", -3, "[-2, 2]"),
        ("seed", -1, "[0, "),
        ("temperature", True, "a number"),
        ("temperature", "hot", "a number"),
    ],
)
def test_out_of_range_names_field_value_and_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(SettingsError) as e:
        SamplingSettings(**{field: value})  # type: ignore[arg-type]
    assert e.value.field == field
    assert field in str(e.value) and repr(value) in str(e.value) and allowed in str(e.value)
    assert isinstance(e.value, ValueError)


def test_token_bias_validated() -> None:
    with pytest.raises(SettingsError, match=r"token_bias\[3\]"):
        SamplingSettings(token_bias={3: 500.0})
    with pytest.raises(SettingsError, match="token id in"):
        Sampler(SamplingSettings(token_bias={10: 1.0}), vocab_size=10)


def test_token_bias_moves_only_its_ids_and_its_dense_row_is_built_on_demand() -> None:
    """The bias is added in place as (ids, values); the (vocab,) row the CUDA sampler's kernel takes is built once,
    when first asked for, and holds the same values."""
    biased = Sampler(SamplingSettings(temperature=0.0, token_bias={3: 2.5, 7: -100.0}), vocab_size=10)
    x = torch.arange(10, dtype=torch.float32)
    adjusted = biased._adjust(x, [])
    assert torch.equal(adjusted, x + torch.tensor([0, 0, 0, 2.5, 0, 0, 0, -100.0, 0, 0]))
    assert torch.equal(x, torch.arange(10, dtype=torch.float32))  # the logits row itself is left alone
    assert biased._dense_bias is None
    row = biased._bias
    assert row is not None and row is biased._bias
    assert torch.equal(row, torch.tensor([0, 0, 0, 2.5, 0, 0, 0, -100.0, 0, 0]))
    assert Sampler(SamplingSettings(), vocab_size=10)._bias is None


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "1" * 5000, "-1", "+3", " 3", "3.0", "", "0x10", "12"])
def test_token_id_keys_are_ascii_digits_inside_the_vocabulary(key: str) -> None:
    """One rule for every token-id key (websocket token_bias, /v1 logit_bias): "²" and "٣" pass str.isdigit()."""
    with pytest.raises(SettingsError, match="ASCII digits") as e:
        token_id(key, vocab_size=10)
    assert len(str(e.value)) < 200  # a 5,000-digit key is shown cut short, never parsed
    assert token_id("9", vocab_size=10) == 9 and token_id("123456789") == 123456789


def _logits(*vals: float) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32)


def test_greedy_is_argmax_and_bias_can_flip_it() -> None:
    x = _logits(0.0, 3.0, 1.0)
    assert Sampler(SamplingSettings(temperature=0), 3).sample(x, []).token == 1
    assert Sampler(SamplingSettings(temperature=0, token_bias={2: 2.5}), 3).sample(x, []).token == 2


def test_repetition_penalty_respects_range() -> None:
    x = _logits(2.0, 1.5)
    s = SamplingSettings(temperature=0, repetition_penalty=1.5, repetition_range=2)
    assert Sampler(s, 2).sample(x, [0, 1, 1]).token == 0  # token 0 is outside the last 2
    assert Sampler(s, 2).sample(x, [1, 0, 0]).token == 1  # 2.0 / 1.5 < 1.5 and token 1 is outside


def test_repetition_penalty_multiplies_negative_logits() -> None:
    x = _logits(-1.0, -1.2)
    s = SamplingSettings(temperature=0, repetition_penalty=1.5)
    assert Sampler(s, 2).sample(x, [0]).token == 1  # -1.5 < -1.2


def test_frequency_and_presence_penalties() -> None:
    x = _logits(2.0, 1.9)
    freq = SamplingSettings(temperature=0, frequency_penalty=0.06)
    assert Sampler(freq, 2).sample(x, [0]).token == 0  # 2 - 0.06 > 1.9
    assert Sampler(freq, 2).sample(x, [0, 0]).token == 1  # 2 - 0.12 < 1.9
    pres = SamplingSettings(temperature=0, presence_penalty=0.2)
    assert Sampler(pres, 2).sample(x, [0, 0, 0]).token == 1


def _counts(settings: SamplingSettings, x: torch.Tensor, n: int) -> torch.Tensor:
    sampler = Sampler(settings, x.numel())
    counts = torch.zeros(x.numel())
    for _ in range(n):
        counts[sampler.sample(x, []).token] += 1
    return counts


def test_unfiltered_draws_follow_softmax() -> None:
    x = _logits(1.0, 0.0, -1.0, 0.5)
    n = 4000
    counts = _counts(SamplingSettings(**PLAIN, seed=1), x / 0.7, n)
    p = torch.softmax(x / 0.7, 0)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


def test_temperature_sharpens() -> None:
    x = _logits(1.0, 0.0)
    hot = _counts(SamplingSettings(**{**PLAIN, "temperature": 2.0}, seed=2), x, 2000)[0]
    cold = _counts(SamplingSettings(**{**PLAIN, "temperature": 0.25}, seed=2), x, 2000)[0]
    assert cold > 1900 and 1100 < hot < 1400  # p0 = 0.982 and 0.622


@pytest.mark.parametrize(
    ("override", "support"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.6}, {0, 1}),  # probs .5 .3 .15 .05: .5 < .6 so the second is kept, the third not
        ({"min_p": 0.5}, {0, 1}),  # .3 >= .25, .15 < .25
        ({"typical_p": 0.3}, {1}),  # H = 1.142 nats; |-log p - H|: .5 -> .45, .3 -> .06, .15 -> .76, .05 -> 1.85
    ],
)
def test_truncation_support(override: dict[str, float], support: set[int]) -> None:
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    counts = _counts(SamplingSettings(**{**PLAIN, **override}, seed=3), x, 600)
    assert {i for i in range(4) if counts[i] > 0} == support


def test_sampled_prob_is_the_renormalised_probability() -> None:
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingSettings(**{**PLAIN, "top_k": 2}, seed=0), 4)
    for _ in range(20):
        c = sampler.sample(x, [], want_probs=True)
        expected = {0: 0.5 / 0.8, 1: 0.3 / 0.8}[c.token]
        assert c.sampled_prob == pytest.approx(expected, rel=1e-5)
        assert c.prob == pytest.approx([0.5, 0.3][c.token], rel=1e-5)


def test_probability_rank_and_alternatives_use_raw_logits() -> None:
    x = _logits(0.0, 2.0, 1.0, -1.0)
    s = SamplingSettings(temperature=0, token_bias={3: 10.0})
    c = Sampler(s, 4).sample(x, [], top_alts=3, want_logits=True)
    p = torch.softmax(x, 0)
    assert c.token == 3
    assert c.prob == pytest.approx(float(p[3]))
    assert c.rank == 4
    assert [i for i, _ in c.top] == [1, 2, 0]
    assert [q for _, q in c.top] == pytest.approx([float(p[1]), float(p[2]), float(p[0])])
    assert c.logits is not None and torch.equal(c.logits, x)


def test_probabilities_off_by_default() -> None:
    c = Sampler(SamplingSettings(seed=0), 4).sample(_logits(0.0, 2.0, 1.0, -1.0), [])
    assert c.prob is None and c.rank is None and c.top == [] and c.logits is None


def test_seed_reproduces_and_differs() -> None:
    x = torch.randn(50, generator=torch.Generator().manual_seed(0))

    def run(seed: int) -> list[int]:
        sampler = Sampler(SamplingSettings(**PLAIN, seed=seed), 50)
        return [sampler.sample(x, []).token for _ in range(40)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_random_seed_when_none() -> None:
    assert Sampler(SamplingSettings(), 4).seed != Sampler(SamplingSettings(), 4).seed
    assert not math.isnan(Sampler(SamplingSettings(), 4).seed)


# one batched call (webchat.engine.sampling.sample_batch) gives each row what its own sampler gives it alone
MIXED_ROWS = [
    (SamplingSettings(temperature=0.0), 0, False),
    (SamplingSettings(temperature=0.0, token_bias={3: 30.0, 7: -100.0}), 5, True),
    (SamplingSettings(temperature=0.8, seed=11), 0, False),
    (SamplingSettings(temperature=1.2, top_k=0, top_p=0.9, min_p=0.0, seed=12), 5, True),
    (SamplingSettings(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, seed=13), 20, True),
    (SamplingSettings(temperature=0.0, presence_penalty=1.0, token_bias={9: 2.0}), 3, True),
    (SamplingSettings(temperature=1.0, typical_p=0.8, token_bias={1: 5.0}, seed=14), 0, True),
    (SamplingSettings(temperature=0.0), 20, False),
]


# with and without a penalised row (each row's adjustments, or the token bias alone)
UNPENALISED = [r for r in MIXED_ROWS if not r[0].penalised]


@pytest.mark.parametrize("rows", [MIXED_ROWS, UNPENALISED], ids=["mixed", "unpenalised"])
def test_sample_batch_equals_each_row_alone(rows: list[tuple[SamplingSettings, int, bool]]) -> None:
    vocab, gen = 300, torch.Generator().manual_seed(0)
    history = torch.randint(0, vocab, (40,), generator=gen).tolist()
    batched = [Sampler(s, vocab) for s, _, _ in rows]
    alone = [Sampler(s, vocab) for s, _, _ in rows]
    for b, a in zip(batched, alone, strict=True):  # unseeded rows: the same stream for both copies
        a.rng.manual_seed(b.seed)
    for step in range(6):  # several steps: each row's random stream advances once per sampled token, in both
        logits = torch.randn(len(rows), vocab, generator=gen) * 4
        if step % 2:  # as the forward returns them: inference tensors
            with torch.inference_mode():
                logits = logits.clone()
        before = logits.clone()
        asks = [RowAsk(sm, history, top_alts=k, want_probs=probs, want_logits=i == 3)
                for i, (sm, (_, k, probs)) in enumerate(zip(batched, rows, strict=True))]
        got = sample_batch(logits, asks)
        assert torch.equal(logits, before)  # the caller's logits as they were
        for i, (sm, (_, k, probs)) in enumerate(zip(alone, rows, strict=True)):
            want = sm.sample(logits[i], history, top_alts=k, want_probs=probs, want_logits=i == 3)
            assert (got[i].token, got[i].prob, got[i].sampled_prob, got[i].rank, got[i].top) == (
                want.token, want.prob, want.sampled_prob, want.rank, want.top), f"row {i}"
            assert (got[i].logits is None) == (want.logits is None)
            if want.logits is not None:
                assert torch.equal(got[i].logits, want.logits)
        history = history + [got[0].token]


def test_sample_batch_refuses_a_row_count_mismatch() -> None:
    with pytest.raises(ValueError, match="2 asks for 3 logits rows"):
        sample_batch(torch.zeros(3, 10), [RowAsk(Sampler(SamplingSettings(), 10), [])] * 2)
