"""The engine seam: what both front ends (the websocket in webchat.serve.app, `/v1` in webchat.serve.openai.routes)
hand a request to, and what comes back.

A front end builds a `Job` (the prompt as token ids *and* as chat messages, the sampling request, and `deliver`,
which runs on the event loop with each neutral event of webchat.engine.events) and gives it to a `Backend`. Two
implementations: webchat.serve.worker.Worker drives the local batched engine on the device thread; a remote
OpenAI-compatible engine (vLLM, SGLang, llama.cpp's server) is the other. Front ends never know which one runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from webchat.engine import events as ev
from webchat.engine.sequence import GenerationRequest, Sequence
from webchat.serve.thinking import Ask

Deliver = Callable[[ev.Event], None]


@dataclass(frozen=True)
class Scoring:
    """What a `score` job answers (webchat.serve.scoring): the tokens of `target` within its prompt; `text`: the prompt
    is `target` alone (a pasted text), else `target` is the last message of the job's chat."""

    target: str
    text: bool = False


@dataclass
class Job:
    """One `generate` request: the generator request, where its messages go, and its place in the schedule."""

    key: Hashable  # the connection (websocket) or the API request: one session, at most one job at a time
    request_id: str
    request: GenerationRequest
    deliver: Deliver  # runs on the event loop
    prompt_tokens: int = 0
    client: Hashable = None  # who is asking, for fair admission: a websocket connection, an API key or a peer address
    messages: list[dict[str, Any]] | None = None  # the chat the prompt ids were encoded from (None: a raw prompt)
    continue_final: bool = False  # the last message is an assistant prefix to continue
    prefix_ids: list[int] | None = None  # that prefix as the model's token ids (a branch), sent as ids where taken
    model: str | None = None  # the model it runs on (webchat.serve.models; None: the default)
    scoring: Scoring | None = None  # a `score` request: which text's tokens it reports (webchat.serve.scoring)
    # a remote engine's pass-through: the client's response_format / structured_outputs / tools / tool_choice /
    # parallel_tool_calls, as sent (webchat.serve.tools.upstream_fields); the upstream enforces them
    upstream: dict[str, Any] | None = None
    thinking: Ask | None = None  # its template variables and reasoning budget (a remote engine sends them on)
    # the backend's bookkeeping
    position: int = 0  # last `queued` position sent; 0 = never queued
    seq: Sequence | None = None  # the local engine's sequence while it runs
    started: bool = False
    next_send: float = 0.0  # perf_counter before which the local worker holds the job's tokens (its stream interval)
    cancel_requested: bool = False
    dropped: bool = False  # the client left: no more messages, no done


@dataclass
class Snapshot:
    active: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    sessions: int = 0


class Backend(Protocol):
    """Where jobs run. Every method is called from the event loop and never blocks on the model."""

    def start(self) -> None: ...
    def stop(self, timeout: float = 10.0) -> None: ...
    def submit(self, job: Job) -> None:
        """Queue a job; answers through job.deliver (`busy`/`busy_connection` failures included)."""
    def cancel(self, key: Hashable, request_id: str) -> None:
        """`stop`: the job ends at its next step with `done` cancelled."""
    def close(self, key: Hashable) -> None:
        """The connection is gone: drop its job and free its session."""
    def snapshot(self) -> Snapshot: ...
