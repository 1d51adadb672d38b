"""What a request's speculative mode gets (`auto`, `none`, `self`, `ngram`, `draft`): a drafter for the fixed modes,
kept per owner where it has a cache of its own, or the auto mode's per-sequence offers to the engine-wide planner;
and the planner's cost curve, measured here.

    spec = Speculation(model, pool, capacity, draft_model=None, self_draft_layers=None)
    drafter, offers = spec.for_request(owner, mode, prompt_len)    # one of the two, or neither (`none`)
    spec.forget(owner); spec.calibrate() / spec.calibration()
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from webchat.engine.spec import verify_cost
from webchat.engine.spec.drafters import (
    MODES,
    Drafter,
    DraftModel,
    ModelDrafter,
    NgramDrafter,
    SelfDrafter,
    check_vocab,
)
from webchat.engine.spec.offers import SeqDrafter
from webchat.engine.spec.planner import AutoSpec
from webchat.model.kv_cache import KVPool


class Speculation:
    """The drafters the modes name and the auto mode's planner, for one engine's model and pool."""

    def __init__(self, model: DraftModel, pool: KVPool, capacity: int, draft_model: DraftModel | None = None,
                 self_draft_layers: int | None = None, native_index: Callable[..., Any] | None = None,
                 breaks: list[str] | None = None) -> None:  # fmt: skip
        if draft_model is not None:
            check_vocab(model, draft_model)
        self.model, self.pool, self.capacity, self.draft_model = model, pool, capacity, draft_model
        self.self_draft = SelfDrafter(model, self_draft_layers or max(1, model.args.n_layers // 4), pool)
        self.auto = AutoSpec(native_index=native_index)  # the cost curve, the shared outputs, the planner
        self.auto.set_breaks(breaks or [])
        self._models: dict[int, ModelDrafter] = {}  # per owner: a draft model's cache of its own
        self._ngrams: dict[int, NgramDrafter] = {}  # per owner: its n-gram index
        self._calibrate_at = 0  # the step from which a failed calibration (no free pages) is tried again

    def check(self, mode: str) -> None:
        """ValueError naming a mode this engine cannot run."""
        if mode not in MODES:
            raise ValueError(f"speculative must be one of {list(MODES)}, got {mode!r}")
        if mode == "draft" and self.draft_model is None:
            raise ValueError("speculative 'draft' needs a draft model; this generator has none")

    def for_request(self, owner: object, mode: str, prompt_len: int) -> tuple[Drafter | None, SeqDrafter | None]:
        """(the fixed mode's drafter, the auto mode's offers) of a new sequence; (None, None) for `none`."""
        if mode == "none":
            return None, None
        if mode == "auto":  # its own each time; a draft model's cache (per owner) comes along
            model = self._model_drafter(owner) if self.draft_model is not None else None
            return None, SeqDrafter(self.auto, prompt_len, model)
        if mode == "self":
            return self.self_draft, None
        if mode == "draft":
            return self._model_drafter(owner), None
        return self._ngrams.setdefault(id(owner), NgramDrafter()), None

    def _model_drafter(self, owner: object) -> ModelDrafter:
        if id(owner) not in self._models:
            assert self.draft_model is not None  # check() refuses `draft` without one
            self._models[id(owner)] = ModelDrafter(self.draft_model, self.capacity)
        return self._models[id(owner)]

    def forget(self, owner: object) -> None:
        """An owner gone: its drafters' caches go too."""
        self._models.pop(id(owner), None)
        self._ngrams.pop(id(owner), None)

    def calibrate(self, steps: int) -> bool:
        """Measure what verify rows cost on this model and machine, for the auto mode's plans (the server does it at
        warm-up; otherwise the first auto step does). False when the pool had no free pages to measure in: tried again
        64 steps later (`steps`: the engine's step count)."""
        return verify_cost.drain(self.calibration(steps))

    def calibration(self, steps: int) -> Generator[None, None, bool]:
        """calibrate(), one forward a step (a model loaded beside other models' streams holds the device for one
        verify forward at a time)."""
        if steps < self._calibrate_at:
            return False
        cost = yield from verify_cost.calibration(self.model, self.pool, self.capacity)
        if cost is None:
            self._calibrate_at = steps + 64
            return False
        self.auto.sampled_row_ms = verify_cost.sampling_ms(self.model.args.vocab_size)
        if self.draft_model is not None:
            self.draft_model.ensure_rope(verify_cost.CONTEXT)
            self.auto.draft_token_ms = verify_cost.draft_ms(self.draft_model,
                                                            self.draft_model.new_pool(verify_cost.CONTEXT),
                                                            verify_cost.CONTEXT)
        self.auto.cost = cost
        return True
