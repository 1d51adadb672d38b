"""The streaming generator: a connection's handle on the engine, text and probabilities one step at a time.

    gen.begin_stream(GenerationRequest(prompt_ids=ids, ...)) -> StartInfo
    while not (res := gen.stream()).eos: print(res.text, end="")

Built alone, a Generator owns an Engine (webchat.engine.engine) sized for one sequence; built with `engine=`, many
handles share one engine and each stream() call returns what the engine produced for this handle since the last call,
stepping the engine (every running sequence at once) when nothing is waiting. The prompt is prefilled in chunks,
one per step (those calls return empty results), so cancel() takes effect between chunks. A prompt sharing a prefix
with the handle's last turn (or with pages another handle computed) prefills only the rest.

Speculative decoding (request.speculative = "draft" | "self" | "ngram") verifies up to `draft_tokens` drafted tokens
with the main model in the same forward as everyone else's tokens. A draft token is accepted only if it equals the
main model's own sample at that position, drawn from the main model's distribution with the sequence's generator
(exllamav2's rule): every emitted token is the main model's sample, one uniform drawn per emitted token in order, so
the output for a given seed is the same with and without speculation (greedy: token for token), alone or batched.
"""

from __future__ import annotations

from webchat.engine.engine import PREFILL_CHUNK, Engine, Model, Tokenizer
from webchat.engine.sequence import GenerationRequest, Sequence, StartInfo, StreamResult

__all__ = ["Generator"]  # the request and result types live in webchat.engine.sequence: one import path


class Generator:
    """One connection's stream on an engine (its own, for `max_seq_len` positions, unless `engine` is given)."""

    def __init__(self, model: Model, tokenizer: Tokenizer, max_seq_len: int | None = None,
                 draft_model: Model | None = None, self_draft_layers: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, engine: Engine | None = None) -> None:
        if engine is None:
            engine = Engine(model, tokenizer, max_seq_len=max_seq_len, draft_model=draft_model,
                            self_draft_layers=self_draft_layers, prefill_chunk=prefill_chunk)
        self.engine = engine
        self._seq: Sequence | None = None

    @property
    def capacity(self) -> int:
        """Positions one sequence may reach (prompt + reply)."""
        return self.engine.capacity

    @property
    def cache_ids(self) -> list[int]:
        """The tokens whose k/v this handle holds in the pool."""
        return self.engine.cached_ids(self)

    def begin_stream(self, req: GenerationRequest) -> StartInfo:
        """Check the request and join the engine, reusing the longest cached prefix; prefill happens in stream()."""
        if self._seq is not None and not self._seq.done:
            self._seq.cancel.set()
            self.engine.step()  # ends it: one sequence per handle
            self.engine.take(self._seq)
        self._seq, info = self.engine.add(self, req)
        return info

    def stream(self) -> StreamResult:
        """This handle's next result: a prefill chunk (empty), one sampled token, or several with speculation."""
        seq = self._seq
        if seq is None:
            raise RuntimeError("no stream in progress: call begin_stream() first")
        res = self.engine.take(seq)
        if res is None:
            if seq.done:
                raise RuntimeError("no stream in progress: call begin_stream() first")
            self.engine.step()
            res = self.engine.take(seq) or StreamResult()
        return res

    def cancel(self) -> None:
        """Thread-safe: the stream ends at its next step (between prefill chunks too) with eos_reason "cancelled"."""
        if self._seq is not None:
            self._seq.cancel.set()

    def close(self) -> None:
        """Thread-safe: the connection is gone; its pages go back to the pool at the engine's next step."""
        self.cancel()
        self.engine.close(self)
