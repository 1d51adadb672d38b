"""The torch sampler that turns a logits row into a token, for the settings of webchat.engine.settings."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Protocol

import torch

from webchat.engine import constraint as cst
from webchat.engine.settings import MAX_TOP_ALTS, SamplingSettings, check_token_ids


@dataclass
class Choice:
    """One sampled token and, when asked for, what the model thought of it.

    prob: softmax(raw logits)[token]; sampled_prob: probability under the distribution actually drawn from
    (after penalties, temperature and truncation; 1.0 when greedy); rank: 1-based under the raw logits;
    top: [(id, prob)] by raw probability, descending; forbidden: the ids of top the row's mask did not allow.
    """

    token: int
    prob: float | None = None
    sampled_prob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] = field(default_factory=list)
    logits: torch.Tensor | None = None
    forbidden: list[int] = field(default_factory=list)


class Sampler:
    """Draws tokens for one stream with its own seeded torch.Generator: exactly one uniform per sampled token."""

    def __init__(self, settings: SamplingSettings, vocab_size: int) -> None:
        check_token_ids(settings.token_bias, vocab_size, "token_bias key")
        self.settings = settings
        self.vocab_size = vocab_size
        self.seed = settings.seed if settings.seed is not None else secrets.randbits(63)
        self.rng = torch.Generator(device="cpu").manual_seed(self.seed)
        # token_bias as (ids, values), added in place where a row is adjusted (the keys are unique; adding 0.0 to the
        # other ids would change nothing): no (vocab,) row built for each request
        self._bias_ids: torch.Tensor | None = None
        self._bias_values = torch.zeros(0)
        self._dense_bias: torch.Tensor | None = None
        if settings.token_bias:
            self._bias_ids = torch.tensor(list(settings.token_bias), dtype=torch.long)
            self._bias_values = torch.tensor(list(settings.token_bias.values()), dtype=torch.float32)
        # the same as lists, for RowScan.argmax_rows (which adds them as it scans a greedy row: no torch op)
        self._bias_lists: tuple[list[int], list[float]] = (list(settings.token_bias), self._bias_values.tolist())

    def _add_bias(self, row: torch.Tensor) -> None:
        """Add token_bias to a (vocab,) row in place, at its ids only."""
        if self._bias_ids is not None:
            row.index_add_(0, self._bias_ids.to(row.device), self._bias_values.to(row.device, row.dtype))

    @property
    def _bias(self) -> torch.Tensor | None:
        """token_bias as a (vocab,) row (the CUDA sampler's kernel takes one), built when first asked."""
        if self._bias_ids is not None and self._dense_bias is None:
            self._dense_bias = torch.zeros(self.vocab_size).index_put_((self._bias_ids,), self._bias_values)
        return self._dense_bias

    def sample(self, logits: torch.Tensor, history: list[int], top_alts: int = 0, want_probs: bool = False,
               want_logits: bool = False, mask: torch.Tensor | None = None) -> Choice:
        """logits: (vocab,) raw row for the next position; history: every token before it (prompt + reply); mask:
        the tokens allowed (webchat.engine.constraint's bitmask), None for all."""
        raw = logits.float()
        x = self._adjust(raw.cpu(), history, mask)
        token, sampled_prob = self._draw(x)
        choice = Choice(token=token, sampled_prob=sampled_prob if want_probs or top_alts else None)
        if want_probs or top_alts:
            _describe(choice, raw, min(top_alts, MAX_TOP_ALTS))
            _mark_forbidden(choice, mask)
        if want_logits:
            choice.logits = raw.detach().cpu().clone()
        return choice

    def _adjust(self, x: torch.Tensor, history: list[int], mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token bias, penalties and the mask; returns a new (vocab,) row (x itself when nothing applies)."""
        s = self.settings
        if mask is not None:
            x = x.clone()
            cst.apply(x, mask)
        if self._bias_ids is not None:
            x = x.clone() if mask is None else x
            self._add_bias(x)
        if not s.penalised or not history:
            return x
        window = history[-s.repetition_range:] if s.repetition_range else history
        ids = torch.tensor(window, dtype=torch.long)
        counts = torch.bincount(ids, minlength=self.vocab_size)[: self.vocab_size].to(x.dtype)  # (vocab,)
        seen = counts > 0
        x = x.clone()
        if s.repetition_penalty != 1.0:
            # CTRL: positive logits divided, negative multiplied
            x = torch.where(seen & (x > 0), x / s.repetition_penalty, x)
            x = torch.where(seen & (x <= 0), x * s.repetition_penalty, x)
        # OpenAI: logit -= frequency * count + presence * [count > 0]
        return x - s.frequency_penalty * counts - s.presence_penalty * seen.to(x.dtype)

    def _draw(self, x: torch.Tensor) -> tuple[int, float]:
        if self.settings.greedy:
            return int(torch.argmax(x)), 1.0
        u = float(torch.rand((), generator=self.rng, dtype=torch.float64))  # one uniform per sampled token
        token, sampled_prob = draw(x, self.settings, u)
        return int(token), float(sampled_prob)


def draw(x: torch.Tensor, s: SamplingSettings, u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw for a uniform u in [0, 1) over the candidates the settings keep: (token, sampled_prob) as 0-d
    tensors on x's device, without host syncs, so the same code serves the CPU and the GPU sampler."""
    probs = torch.softmax(x / s.temperature, dim=-1)
    if s.top_k and s.top_k < probs.numel():
        vals, idx = torch.topk(probs, s.top_k)  # sorted descending
    else:
        vals, idx = torch.sort(probs, descending=True)
    vals = truncate(vals, s)
    cdf = torch.cumsum(vals.double(), dim=0)
    total = cdf[-1]
    pos = torch.searchsorted(cdf, (u * total).reshape(1), right=True).clamp_(max=vals.numel() - 1)  # (1,)
    at = torch.arange(vals.numel(), device=vals.device)
    pos = torch.where((vals > 0) & (at <= pos), at, 0).max().reshape(1)  # u rounded up onto total: last kept one
    # index_select, not idx[pos]: indexing with a 0-d tensor reads it on the host (a sync per token on a GPU)
    return idx.index_select(0, pos)[0], vals.index_select(0, pos)[0].double() / total


def truncate(vals: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """vals: candidate probabilities sorted descending; zero out what top-p, min-p and typical-p drop.

    Written without host syncs, so the same code serves the CPU and the GPU sampler (webchat.kernels.cuda.sampler).
    """
    keep = torch.ones_like(vals, dtype=torch.bool)
    if s.top_p < 1.0:
        before = torch.cumsum(vals, 0) - vals  # mass strictly above each candidate
        keep &= before < s.top_p * vals.sum()
    if s.min_p > 0.0:
        keep &= vals >= s.min_p * vals[0]
    if s.typical_p < 1.0:
        keep &= typical_mask(vals / vals.sum(), s.typical_p)
    keep[0] = keep[0] | ~keep.any()  # the filters disagree on everything: fall back to the most likely token
    return torch.where(keep, vals, torch.zeros_like(vals))


def typical_mask(p: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling: keep the tokens with -log p closest to the entropy H until `mass` is covered."""
    logp = torch.log(p.clamp_min(1e-30))
    entropy = -(p * logp).sum()
    order = torch.argsort((-logp - entropy).abs())
    before = torch.cumsum(p[order], 0) - p[order]
    return torch.zeros_like(p, dtype=torch.bool).scatter_(0, order, before < mass)


def _describe(choice: Choice, raw: torch.Tensor, top_alts: int) -> None:
    """Fill prob, rank and top alternatives from the raw logits (softmax over the whole row)."""
    _describe_rows([choice], raw.reshape(1, -1), [0], [top_alts])


@dataclass
class RowAsk:
    """What one logits row of a batch wants: its sequence's sampler and history, and how much to describe."""

    sampler: Sampler
    history: list[int]
    top_alts: int = 0
    want_probs: bool = False
    want_logits: bool = False
    mask: torch.Tensor | None = None  # the tokens allowed (webchat.engine.constraint's bitmask); None: all


class RowScan(Protocol):
    """Scans of CPU logits rows in C++ (webchat.kernels.cpu, csrc/qsample.cpp; a CPU model's `row_scan`): the greedy
    pick and the description of _describe_rows, a few passes over a row on the calling thread instead of ~10 torch
    ops spread over the OpenMP team (0.4 ms -> 0.04 ms a token on a 49,152-token vocabulary). The same tokens, ranks
    and alternatives; probabilities from a double-precision sum, within ~1e-5 relative of torch's float32 ones."""

    def argmax_rows(self, x: torch.Tensor, ids: list[list[int]] = ..., values: list[list[float]] = ...) -> list[int]:
        """Row r's first largest value, values[r] added at ids[r] for the scan (its logits left as they were)."""

    def describe_rows(self, x: torch.Tensor, rows: list[int], tokens: list[int],
                      ks: list[int]) -> list[tuple[float, int, list[tuple[int, float]]]]: ...  # fmt: skip


def sample_batch(logits: torch.Tensor, asks: list[RowAsk], scan: RowScan | None = None) -> list[Choice]:
    """One call for a batch's rows: logits (N, vocab), row i sampled with asks[i]'s settings and its own random stream.

    Each Choice equals what asks[i].sampler.sample(logits[i], ...) returns, token and numbers alike: a row's result
    does not depend on the batch. The work that needs no per-row state runs once for all rows: token bias, the
    greedy argmax, and the description (log-softmax, rank, top alternatives, one top-k per distinct k), by `scan`
    where the model has one. Penalties and random draws stay per row, each from its sampler's own generator (one
    uniform per sampled token). Samplers of another kind (the CUDA sampler) and logits off the CPU are sampled row by
    row.
    """
    if logits.shape[0] != len(asks):
        raise ValueError(f"{len(asks)} asks for {logits.shape[0]} logits rows")
    if logits.device.type != "cpu" or any(type(a.sampler) is not Sampler for a in asks):
        return [a.sampler.sample(logits[i], a.history, a.top_alts, a.want_probs, a.want_logits, a.mask)
                for i, a in enumerate(asks)]
    raw = logits if logits.dtype == torch.float32 else logits.float()  # (each torch call costs after a forward)
    x = raw
    # rows adjusted one by one (the bias rides along): penalties need the history, a mask its bits
    penalised = [i for i, a in enumerate(asks) if (a.sampler.settings.penalised and a.history) or a.mask is not None]
    biased = [i for i, a in enumerate(asks) if a.sampler._bias_ids is not None and i not in penalised]
    # a greedy row's bias alone (an API client's logit_bias, on every token) is added by the scan as it looks for the
    # largest logit: no copy of the rows and no torch op, each of which costs tens of microseconds after a forward
    scan_bias = scan is not None and not penalised and all(asks[i].sampler.settings.greedy for i in biased)
    if penalised or (biased and not scan_bias):
        x = raw.clone()
        for i in biased:  # only the biased ids (adding 0.0 elsewhere changes nothing): no (N, vocab) temporaries
            asks[i].sampler._add_bias(x[i])
        for i in penalised:
            x[i] = asks[i].sampler._adjust(raw[i], asks[i].history, asks[i].mask)
    greedy = [i for i, a in enumerate(asks) if a.sampler.settings.greedy]
    tokens = [0] * len(asks)
    sampled = [1.0] * len(asks)
    if greedy:
        xg = x[torch.tensor(greedy)] if len(greedy) < len(asks) else x if x.is_contiguous() else x.contiguous()
        if scan is None:
            picks = xg.argmax(-1).tolist()
        elif scan_bias and biased:
            lists = [asks[i].sampler._bias_lists for i in greedy]  # ([], []) where a sampler has no bias
            picks = scan.argmax_rows(xg, [ids for ids, _ in lists], [values for _, values in lists])
        else:
            picks = scan.argmax_rows(xg)
        for i, t in zip(greedy, picks, strict=True):
            tokens[i] = t
    for i, a in enumerate(asks):
        if not a.sampler.settings.greedy:
            tokens[i], sampled[i] = a.sampler._draw(x[i])
    choices = [Choice(token=tokens[i], sampled_prob=sampled[i] if a.want_probs or a.top_alts else None)
               for i, a in enumerate(asks)]
    described = [i for i, a in enumerate(asks) if a.want_probs or a.top_alts]
    if described:
        ks = [min(asks[i].top_alts, MAX_TOP_ALTS) for i in described]
        if scan is None:
            _describe_rows(choices, raw, described, ks)
        else:
            found = scan.describe_rows(raw.contiguous(), described, [choices[i].token for i in described], ks)
            for i, (prob, rank, top) in zip(described, found, strict=True):
                choices[i].prob, choices[i].rank, choices[i].top = prob, rank, top
        for i in described:
            _mark_forbidden(choices[i], asks[i].mask)
    for i, a in enumerate(asks):
        if a.want_logits:
            choices[i].logits = raw[i].detach().cpu().clone()
    return choices


def _mark_forbidden(choice: Choice, mask: torch.Tensor | None) -> None:
    if mask is not None:
        choice.forbidden = [t for t, _ in choice.top if not cst.allows(mask, t)]


def describe(logits: torch.Tensor, rows: list[int], tokens: list[int], k: int,
             scan: RowScan | None = None) -> list[Choice]:  # fmt: skip
    """What the model thought of given tokens (a prompt's, scored): for logits row rows[j], tokens[j]'s probability
    and rank and k alternatives, as a sampled token's are described."""
    choices = [Choice(token=t) for t in tokens]
    if not rows:
        return choices
    k = min(k, MAX_TOP_ALTS)
    if scan is None or logits.device.type != "cpu":  # _describe_rows reads choices[i] for logits row i
        sub = logits.float().index_select(0, torch.tensor(rows, device=logits.device))
        _describe_rows(choices, sub, list(range(len(rows))), [k] * len(rows))
        return choices
    x = logits if logits.dtype == torch.float32 and logits.is_contiguous() else logits.float().contiguous()
    for c, (prob, rank, top) in zip(choices, scan.describe_rows(x, rows, tokens, [k] * len(rows)), strict=True):
        c.prob, c.rank, c.top = prob, rank, top
    return choices


def _describe_rows(choices: list[Choice], raw: torch.Tensor, rows: list[int], ks: list[int]) -> None:
    """Fill prob, rank and top alternatives (ks[j] of them) of choices[i] for rows i of raw (N, vocab), all at once:
    softmax over each whole raw row, one top-k call per distinct k."""
    dev = raw.device
    logp = torch.log_softmax(raw.index_select(0, torch.tensor(rows, device=dev)), dim=-1)  # (D, vocab)
    chosen = logp.gather(1, torch.tensor([[choices[i].token] for i in rows], device=dev))  # (D, 1)
    probs, ranks = chosen.exp()[:, 0].tolist(), ((logp > chosen).sum(-1) + 1).tolist()
    for j, i in enumerate(rows):
        choices[i].prob, choices[i].rank = probs[j], int(ranks[j])
    for k in sorted(set(ks) - {0}):
        at = [j for j, kj in enumerate(ks) if kj == k]
        vals, top = torch.topk(logp[torch.tensor(at, device=dev)], k)
        for j, vs, ts in zip(at, vals.exp().tolist(), top.tolist(), strict=True):
            choices[rows[j]].top = [(int(t), float(v)) for t, v in zip(ts, vs, strict=True)]
