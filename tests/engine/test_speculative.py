"""Speculative decoding never changes the output: greedy token for token, sampled same seed same tokens, and the
sampled distribution (chi-square) matches the main model alone."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.tiny import make_tiny_model
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest, StreamResult
from webchat.engine.settings import SamplingSettings
from webchat.engine.spec.drafters import DraftVocabError, ModelDrafter, NgramDrafter, SelfDrafter, check_vocab
from webchat.engine.spec.verify_cost import VerifyCost
from webchat.kernels.backend import load_model
from webchat.text.tokenizer import Tokenizer

GREEDY = SamplingSettings(temperature=0.0)
TOP3 = dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: one intra-op thread is many times faster under load."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def drafts(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A draft that is always right (the same weights, loaded again) and one that is nearly always wrong."""
    return {"same": load_model(tiny_model_dir),
            "other": load_model(make_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1))}


def generate(gen: Generator, prompt: list[int], **kw: Any) -> tuple[list[int], StreamResult]:
    gen.begin_stream(GenerationRequest(prompt_ids=prompt, stop_token_ids=[], **kw))
    ids: list[int] = []
    while True:
        res = gen.stream()
        ids += res.token_ids
        if res.eos:
            return ids, res


PROMPTS = ["Hello world! How are you today?", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
           "Paris is the capital of France. Berlin is the capital of"]


def prompt_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def speculating(gen: Generator, mode: str) -> Generator:
    """A handle whose engine's auto mode grants every draft it is offered ("auto-flat"): every step verifies, so the
    exactness checks cover the verify path whatever this machine's measured costs (plain "auto" plans by them)."""
    if mode.endswith("flat"):
        gen.engine.auto.cost = VerifyCost.flat()
    return gen


@pytest.mark.parametrize("mode", ["self", "ngram", "draft-same", "draft-other", "auto", "auto-flat",
                                  "auto-flat-draft-same", "auto-flat-draft-other"])
def test_greedy_identical_with_speculation(tiny: tuple[Any, Tokenizer], drafts: dict[str, Any], mode: str) -> None:
    model, tok = tiny
    draft = drafts[mode.split("-")[-1]] if "draft" in mode else None
    spec = speculating(Generator(model, tok, draft_model=draft, self_draft_layers=1), mode)
    drafted = accepted = 0
    for text in PROMPTS:
        p = prompt_ids(tok, text)
        plain, _ = generate(Generator(model, tok), p, settings=GREEDY, max_new_tokens=60)
        fast, res = generate(spec, p, settings=GREEDY, max_new_tokens=60, speculative=mode.split("-")[0])
        assert fast == plain
        assert res.stats is not None and res.stats.new_tokens == 60
        cached = spec.cache_ids
        assert len(p) <= len(cached) <= len(p) + 60
        assert cached == (p + fast)[: len(cached)]
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    if mode == "auto":
        return  # drafts only where this machine's costs say they pay: the output is the check
    assert drafted > 0
    if not mode.endswith("draft-other"):
        assert accepted > 0  # the acceptance path ran, not only rejections
    if mode == "draft-same":
        assert accepted == drafted


@pytest.mark.parametrize("mode", ["self", "ngram", "draft", "auto-flat", "auto-flat-draft"])
def test_sampled_same_seed_same_tokens_and_main_model_probabilities(
    tiny: tuple[Any, Tokenizer], drafts: dict[str, Any], mode: str
) -> None:
    """One uniform per emitted token, in order: the seed fixes the output whether or not drafts are verified."""
    model, tok = tiny
    spec = speculating(Generator(model, tok, draft_model=drafts["same"] if mode != "auto-flat" else None,
                                 self_draft_layers=1), mode)
    accepted = 0
    for seed in range(4):
        p = prompt_ids(tok, PROMPTS[seed % len(PROMPTS)])
        kw = dict(settings=SamplingSettings(**TOP3, seed=seed), max_new_tokens=40, return_probs=True, top_alts=3)
        gen_plain = Generator(model, tok)
        gen_plain.begin_stream(GenerationRequest(prompt_ids=p, stop_token_ids=[], **kw))  # type: ignore[arg-type]
        plain = collect(gen_plain)
        spec.begin_stream(GenerationRequest(prompt_ids=p, stop_token_ids=[], speculative=mode.split("-")[0], **kw))  # type: ignore[arg-type]
        fast = collect(spec)
        assert [t.id for t in fast] == [t.id for t in plain]
        for a, b in zip(fast, plain, strict=True):
            assert a.prob == pytest.approx(b.prob, rel=1e-3, abs=1e-5)
            assert a.sampled_prob == pytest.approx(b.sampled_prob, rel=1e-3, abs=1e-5)
            assert a.rank == b.rank and [x[0] for x in a.top] == [x[0] for x in b.top]
        accepted += spec_stats(spec)
    assert accepted > 0


def collect(gen: Generator) -> list[Any]:
    tokens: list[Any] = []
    while True:
        res = gen.stream()
        tokens += res.tokens
        if res.eos:
            gen._last_stats = res.stats  # type: ignore[attr-defined]
            return tokens


def spec_stats(gen: Generator) -> int:
    return int(gen._last_stats.accepted)  # type: ignore[attr-defined]


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile; z = 3.09 is p = 0.001."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def two_sample_chi2(a: Counter[Any], b: Counter[Any]) -> tuple[float, int]:
    """Chi-square of homogeneity for two samples; categories expected under 5 in either arm are pooled."""
    na, nb = sum(a.values()), sum(b.values())
    cells: list[tuple[int, int]] = []
    pool = [0, 0]
    for key in set(a) | set(b):
        oa, ob = a[key], b[key]
        if (oa + ob) * min(na, nb) / (na + nb) < 5:
            pool[0] += oa
            pool[1] += ob
        else:
            cells.append((oa, ob))
    if sum(pool):
        cells.append((pool[0], pool[1]))
    chi2 = 0.0
    for oa, ob in cells:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        chi2 += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return chi2, len(cells) - 1


def test_chi_square_sampled_distribution_matches(tiny: tuple[Any, Tokenizer]) -> None:
    """Tokens 3 and 4 come from the first verification (they depend on accepting or rejecting drafts); different
    seeds in the two arms so that the comparison is statistical, not the seed identity above."""
    model, tok = tiny
    p = prompt_ids(tok, "Hello world!")
    n = 300
    plain_gen, spec_gen = Generator(model, tok), Generator(model, tok, self_draft_layers=1)
    plain: Counter[tuple[int, ...]] = Counter()
    spec: Counter[tuple[int, ...]] = Counter()
    drafted = accepted = 0
    for seed in range(n):
        ids, _ = generate(plain_gen, p, settings=SamplingSettings(**TOP3, seed=n + seed), max_new_tokens=5)
        plain[tuple(ids[2:4])] += 1
        ids, res = generate(spec_gen, p, settings=SamplingSettings(**TOP3, seed=seed), max_new_tokens=5,
                            speculative="self")
        spec[tuple(ids[2:4])] += 1
        assert res.stats is not None
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    chi2, df = two_sample_chi2(spec, plain)
    assert df >= 5
    assert chi2 < chi2_critical(df), (chi2, df, spec.most_common(5), plain.most_common(5))
    assert 0 < accepted < drafted  # both accepted and rejected drafts shaped the sample


def test_ngram_drafter_proposes_what_followed_the_latest_match() -> None:
    d = NgramDrafter(max_n=3)
    ctx = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert d.draft(ctx, 3) == [7, 8, 2]  # [2, 3, 4] last seen before the end at index 6..8, followed by 7, 8, 2
    assert d.draft([*ctx, 7], 2) == [8, 2]
    assert d.draft([5, 6], 4) == []  # a new context (not an extension) resets the index; 6 never seen before
    assert d.draft([5, 6, 5], 4) == [6, 5]
    assert d.draft([1], 0) == []


def test_check_vocab_names_both_sizes(tiny: tuple[Any, Tokenizer], tmp_path: Path) -> None:
    model, tok = tiny
    other_dir = make_tiny_model(tmp_path / "big", seed=0)
    import json

    cfg = json.loads((other_dir / "config.json").read_text())
    fake = type("M", (), {"args": type("A", (), {"vocab_size": cfg["vocab_size"] + 1})()})()
    with pytest.raises(DraftVocabError, match=f"draft model vocabulary has {cfg['vocab_size'] + 1} tokens; the main "
                       f"model has {model.args.vocab_size}"):
        Generator(model, tok, draft_model=fake)
    check_vocab(model, model, tok, Tokenizer.from_dir(other_dir))  # same tokenizer recipe: passes


def test_self_drafter_leaves_the_main_cache_intact(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    p = prompt_ids(tok, PROMPTS[0])
    cache = model.new_cache(128)
    cache.feed(model, p[:-1])
    n, pool = cache.length, cache.pool
    slots = torch.tensor([cache.table.pages[i // pool.page_size] * pool.page_size + i % pool.page_size
                          for i in range(n)])
    before = [k.view(-1, *k.shape[2:])[slots].clone() for k in pool.k]
    cache.table.ensure(len(p) + 4)
    drafter = SelfDrafter(model, 1, pool)
    out = drafter.draft_at(p, 4, cache.table.pages, n)
    assert all(torch.equal(b, k.view(-1, *k.shape[2:])[slots]) for b, k in zip(before, pool.k, strict=True))
    small = model.truncated(1)
    ref = ModelDrafter(small, 128).draft(p, 4)  # the same layers with a cache of their own
    assert out == ref and len(out) == 4


def test_reuse_after_speculation_matches_cold(tiny: tuple[Any, Tokenizer]) -> None:
    """Rejected drafts rewound: a second turn on the cache left by a speculative turn equals a cold start."""
    model, tok = tiny
    gen = Generator(model, tok, self_draft_layers=1)
    p = prompt_ids(tok, PROMPTS[1])
    first, _ = generate(gen, p, settings=GREEDY, max_new_tokens=30, speculative="self")
    p2 = p + first + prompt_ids(tok, "more")
    warm, res = generate(gen, p2, settings=GREEDY, max_new_tokens=30, speculative="none")
    assert res.stats is not None and res.stats.reused_tokens >= len(p) + 25
    cold, _ = generate(Generator(model, tok), p2, settings=GREEDY, max_new_tokens=30)
    assert warm == cold


@pytest.mark.real_model
def test_real_model_greedy_identical_with_self_draft_ngram_and_auto(real_model_dir: Path) -> None:
    model, tok = load_model(real_model_dir), Tokenizer.from_dir(real_model_dir)
    text = ("Fix the typo in this sentence and repeat it: 'The quick brown fox jumps ovre the lazy dog near the "
            "river bank.'")
    p = prompt_ids(tok, text)
    plain, _ = generate(Generator(model, tok, max_seq_len=512), p, settings=GREEDY, max_new_tokens=32)
    for mode in ("self", "ngram", "auto", "auto-flat"):
        gen = speculating(Generator(model, tok, max_seq_len=512), mode)
        ids, res = generate(gen, p, settings=GREEDY, max_new_tokens=32, speculative=mode.split("-")[0])
        assert ids == plain, mode
        assert res.stats is not None and (res.stats.drafted > 0 or mode == "auto")
