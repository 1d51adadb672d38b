"""RemoteEngine: a Backend (webchat.serve.backend) whose jobs run on an upstream OpenAI-compatible engine.

    submit → pending (FIFO, `queued` positions) → active: one asyncio task streaming /v1/chat/completions (a branch
           given as token ids: /v1/completions on the chat's prompt and those ids, where the upstream takes them)
           → Started at the first chunk, Tokens per chunk (one TokenInfo per upstream token), Finished | Failed
Everything runs on the event loop; nothing here blocks. `cancel` and `close` cancel the job's task, which leaves the
stream and closes its connection: the upstream aborts the request (measured in docs/scale-out.md). An upstream that
is down, slow (bounded by the client's timeout), answers 4xx/5xx, sends a malformed chunk or closes mid-stream ends
the job with Failed("upstream", <what, naming the upstream>) after the tokens already delivered; other jobs go on.
Capabilities are probed at start and again before the next job once a request found the upstream unreachable.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from contextlib import aclosing
from typing import Any

from webchat.engine import events as ev
from webchat.serve.backend import Job, Snapshot
from webchat.serve.remote.capabilities import Capabilities, detect
from webchat.serve.remote.client import Upstream, UpstreamError
from webchat.serve.remote.parse import ChunkError, ReportedError, StreamParser
from webchat.serve.remote.scoring import score_upstream
from webchat.serve.remote.thinking import text_split, thinking_fields

log = logging.getLogger("webchat.serve.remote")


def conversation_key(messages: list[dict[str, str]]) -> str:
    """A stable key per conversation (its system prompt and first user message) for prefix-affinity routers."""
    head = [m for m in messages if m.get("role") != "assistant"][:2]
    text = "\x1e".join(f"{m.get('role')}\x1f{m.get('content')}" for m in head)
    return "webchat-" + hashlib.sha256(text.encode()).hexdigest()[:24]


class RemoteEngine:
    """At most `max_active` streams open upstream at once, `max_queue` more waiting in FIFO order."""

    def __init__(self, upstream: Upstream, caps: Capabilities, max_active: int, max_queue: int,
                 want_model: str | None = None, affinity_header: str | None = None) -> None:  # fmt: skip
        if max_active < 1 or max_queue < 0:
            raise ValueError(f"need max_active >= 1 and max_queue >= 0, got {max_active} and {max_queue}")
        self.upstream, self.caps, self.want_model = upstream, caps, want_model
        self.affinity_header = affinity_header
        self.max_active, self.max_queue = max_active, max_queue
        self._pending: deque[Job] = deque()
        self._active: dict[Hashable, asyncio.Task[None]] = {}
        self._jobs: dict[Hashable, Job] = {}
        self._refresh: asyncio.Task[Capabilities] | None = None
        self.on_caps: Callable[[Capabilities], None] | None = None  # told each probe's result (RemoteRuntime)

    # ------------------------------------------------------------ the Backend
    def start(self) -> None:
        pass  # tasks start per job on the running loop

    def stop(self, timeout: float = 10.0) -> None:
        for job in self._jobs.values():
            job.dropped = True
        self._pending.clear()
        for task in self._active.values():
            task.cancel()

    def submit(self, job: Job) -> None:
        if job.key in self._jobs:
            running = self._jobs[job.key].request_id
            self._post(job, ev.Failed("busy_connection", f"request {running!r} is still running on this connection"))
            return
        if len(self._active) >= self.max_active and len(self._pending) >= self.max_queue:
            self._post(job, ev.Failed("busy", (
                f"the server is busy: {len(self._active)} requests running and {len(self._pending)} waiting "
                f"(max {self.max_queue}); try again shortly")))
            return
        self._jobs[job.key] = job
        self._pending.append(job)
        self._admit()

    def cancel(self, key: Hashable, request_id: str) -> None:
        job = self._jobs.get(key)
        if job is None or job.request_id != request_id:
            return
        job.cancel_requested = True
        if job in self._pending:
            self._pending.remove(job)
            del self._jobs[key]
            self._post(job, ev.Finished("cancelled", None, ev.Stats(prompt_tokens=job.prompt_tokens)))
            self._admit()
        elif key in self._active:
            self._active[key].cancel()  # leaves the stream: the upstream connection closes

    def close(self, key: Hashable) -> None:
        job = self._jobs.get(key)
        if job is None:
            return
        job.dropped = True
        if job in self._pending:
            self._pending.remove(job)
            del self._jobs[key]
            self._admit()
        elif key in self._active:
            self._active[key].cancel()

    def snapshot(self) -> Snapshot:
        return Snapshot([self._jobs[k].request_id for k in self._active if k in self._jobs],
                        [j.request_id for j in self._pending], len(self._jobs))

    async def aclose(self) -> None:
        self.stop()
        tasks = list(self._active.values())
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        await self.upstream.aclose()

    # ------------------------------------------------------------ scheduling
    def _post(self, job: Job, event: ev.Event) -> None:
        if not job.dropped:
            asyncio.get_running_loop().call_soon(job.deliver, event)

    def _admit(self) -> None:
        while self._pending and len(self._active) < self.max_active:
            job = self._pending.popleft()
            job.started = True
            task = asyncio.get_running_loop().create_task(self._run(job))
            task.add_done_callback(functools.partial(self._reap, job))
            self._active[job.key] = task
        for index, job in enumerate(self._pending):
            if job.position != index + 1:
                job.position = index + 1
                self._post(job, ev.Queued(job.position))

    def _reap(self, job: Job, task: asyncio.Task[None]) -> None:
        """A task cancelled before its first step never runs `_run`'s handlers: its slot and `done` are given here."""
        if self._active.get(job.key) is task:
            self._finish(job)
            self._post(job, ev.Finished("cancelled", None, ev.Stats(prompt_tokens=job.prompt_tokens)))

    def _finish(self, job: Job) -> None:
        self._active.pop(job.key, None)
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        self._admit()

    async def refresh(self) -> Capabilities:
        """Probe again (one probe at a time, shared by every job waiting on it)."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(detect(self.upstream, self.want_model))
        caps = await asyncio.shield(self._refresh)
        self.caps = caps
        if self.on_caps is not None:
            self.on_caps(caps)
        return caps

    # ------------------------------------------------------------ one job
    def body(self, job: Job) -> dict[str, Any]:
        """The upstream request for a job: its messages, the sampling settings, logprobs as the heatmap needs."""
        caps, req = self.caps, job.request
        s = req.settings
        messages = list(job.messages or [])
        body: dict[str, Any] = {
            "model": caps.model, "messages": messages, "stream": True, "max_tokens": req.max_new_tokens or None,
            "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
            "frequency_penalty": s.frequency_penalty, "presence_penalty": s.presence_penalty,
            "stream_options": {"include_usage": True}, "user": conversation_key(messages),
        }
        if caps.kind != "openai-compatible":  # vLLM, SGLang, llama.cpp and webchat take these extensions
            body.update(top_k=s.top_k, min_p=s.min_p, repetition_penalty=s.repetition_penalty)
        if caps.kind == "webchat":
            body.update(typical_p=s.typical_p, repetition_range=s.repetition_range)
        if caps.kind == "llama.cpp":
            body.update(repeat_penalty=s.repetition_penalty, typical_p=s.typical_p)
            del body["repetition_penalty"]
        if s.token_bias:
            body["logit_bias"] = {str(k): v for k, v in s.token_bias.items()}
        if req.stop_strings:
            body["stop"] = list(req.stop_strings)
        if req.return_probs and caps.max_top_logprobs > 0:
            body.update(logprobs=True, top_logprobs=min(req.top_alts, caps.max_top_logprobs))
        elif req.return_probs:
            body["logprobs"] = True
        if caps.token_ids == "return_token_ids":
            body["return_token_ids"] = True
        if job.continue_final and caps.continue_final == "continue_final_message":
            body.update(continue_final_message=True, add_generation_prompt=False)
        body.update(thinking_fields(caps.kind, job.thinking))
        body.update(job.upstream or {})  # the reply format and tools, as the client sent them: the upstream enforces
        # final_assistant_message (llama.cpp): the last assistant message is continued as it stands
        return {k: v for k, v in body.items() if v is not None}

    def by_ids(self, job: Job) -> bool:
        """Whether the job is a branch given as token ids that this upstream can take as ids. Not under a reply format:
        a text completion's grammar would start afresh after the ids; the chat endpoint's continue_final_message lets
        an upstream that replays the kept reply into its grammar (webchat) keep the format."""
        return (bool(job.prefix_ids) and job.continue_final and self.caps.token_prompt in ("tokenize", "apply_template")
                and not (job.upstream or {}).get("response_format"))

    async def completion_body(self, job: Job) -> dict[str, Any]:
        """A branch's request as a text completion: the chat's own prompt (all but the final message, with the
        generation prompt: what the reply was first generated after), then the branch's token ids, never
        re-tokenised. The prompt comes from /tokenize as ids (vLLM, webchat) or from /apply-template as text, sent
        with the ids as one mixed prompt (llama.cpp's server reads `["text", 12, 34]` as one prompt)."""
        caps, history = self.caps, list(job.messages or [])[:-1]
        ids = list(job.prefix_ids or [])
        prompt: list[Any]
        if caps.token_prompt == "tokenize":
            resp = await self.upstream.post_json("/tokenize", {"model": caps.model, "messages": history,
                                                               "add_generation_prompt": True})
            head = resp.get("tokens") if isinstance(resp, dict) else None
            if not isinstance(head, list) or not all(isinstance(t, int) for t in head):
                raise UpstreamError(f"the upstream engine at {self.upstream.url} answered /tokenize without a list "
                                    "of token ids in 'tokens'")
            prompt = [*head, *ids]
        else:
            resp = await self.upstream.post_json("/apply-template", {"messages": history})
            text = resp.get("prompt") if isinstance(resp, dict) else None
            if not isinstance(text, str):
                raise UpstreamError(f"the upstream engine at {self.upstream.url} answered /apply-template without a "
                                    "'prompt' string")
            prompt = [text, *ids]
        body = self.body(job)
        for key in ("messages", "continue_final_message", "add_generation_prompt", "logprobs", "top_logprobs"):
            body.pop(key, None)
        body["prompt"] = prompt
        req = job.request
        if req.return_probs:  # the completions API's logprobs: how many alternatives, 0 for the token's own only
            body["logprobs"] = min(req.top_alts, caps.max_top_logprobs)
        if caps.kind in ("vllm", "webchat", "sglang"):
            body["return_token_ids"] = True
        return body

    async def _run(self, job: Job) -> None:
        stats = ev.Stats(prompt_tokens=job.prompt_tokens)
        t0 = time.perf_counter()
        t_first = 0.0
        started = False
        try:
            if self.caps.state != "ready":
                await self.refresh()
                if self.caps.state != "ready":
                    raise UpstreamError(self.caps.error or f"the upstream engine at {self.upstream.url} is not ready")
            if job.request.prompt_logprobs is not None:  # a `score` (webchat.serve.remote.scoring)
                tokens, stats.prompt_tokens = await score_upstream(self.upstream, self.caps, job)
                self._finish(job)
                for event in (ev.Started(stats.prompt_tokens, 0), ev.PromptTokens(tokens),
                              ev.Finished("max_new_tokens", None, stats)):
                    self._post(job, event)
                return
            if job.messages is None:
                raise UpstreamError(f"a raw prompt cannot be sent to the upstream engine at {self.upstream.url}: "
                                    "it takes chat messages")
            req = job.request
            parser = StreamParser(req.top_alts if req.return_probs else 0)  # alternatives cut to what was asked
            reason: str | None = None
            trigger: str | None = None
            by_ids = self.by_ids(job)
            split = text_split(job.messages, by_ids)
            body = await self.completion_body(job) if by_ids else self.body(job)
            path = "/v1/completions" if by_ids else "/v1/chat/completions"
            headers = {self.affinity_header: body["user"]} if self.affinity_header else None
            async with aclosing(self.upstream.stream(body, headers, path)) as chunks:
                async for chunk in chunks:
                    out = parser.feed(chunk)
                    if split is not None:  # a branch from inside thinking, continued as text: split here
                        out.tokens = split.push(out.tokens) + (split.flush() if out.reason is not None else [])
                        out.text = "".join(t.piece for t in out.tokens)
                    if not started:
                        started = True
                        self._post(job, ev.Started(job.prompt_tokens, 0))
                    if out.text or out.tokens:
                        if not t_first:
                            t_first = time.perf_counter()
                        stats.new_tokens += len(out.tokens) or 1
                        self._post(job, ev.Tokens(out.text, out.tokens))
                    if out.reason is not None:
                        reason, trigger = out.reason, out.trigger
                    if out.usage is not None:
                        stats.prompt_tokens = out.usage.get("prompt_tokens", stats.prompt_tokens)
                        stats.new_tokens = out.usage.get("completion_tokens", stats.new_tokens)
            if reason is None:
                raise UpstreamError(f"the upstream engine at {self.upstream.url} ended the stream without a "
                                    "finish_reason")
            self._stats(stats, t0, t_first)
            if not started:
                self._post(job, ev.Started(job.prompt_tokens, 0))
            self._finish(job)
            self._post(job, ev.Finished(reason, trigger, stats))
        except asyncio.CancelledError:  # cancel() or close(): the stream is closed by now
            self._stats(stats, t0, t_first)
            self._finish(job)
            self._post(job, ev.Finished("cancelled", None, stats))
        except (UpstreamError, ChunkError) as exc:
            if isinstance(exc, UpstreamError):
                message = str(exc)
            elif isinstance(exc, ReportedError):
                message = f"the upstream engine at {self.upstream.url} reported an error mid-reply: {exc}"
            else:
                message = f"the upstream engine at {self.upstream.url} sent a malformed chunk: {exc}"
            if isinstance(exc, UpstreamError) and not exc.reachable:
                self.caps.state, self.caps.error = "unreachable", message  # probe again before the next job
            log.warning("request %r: %s", job.request_id, message)
            self._finish(job)
            overflow = isinstance(exc, UpstreamError) and exc.context_overflow
            self._post(job, ev.Failed("prompt_too_long" if overflow else "upstream", message))
        except Exception as exc:  # a bug: this request ends, the server keeps serving
            log.exception("request %r failed", job.request_id)
            self._finish(job)
            self._post(job, ev.Failed("internal", f"generation failed: {type(exc).__name__}: {exc}"))

    @staticmethod
    def _stats(stats: ev.Stats, t0: float, t_first: float) -> None:
        if t_first:
            stats.ttft_ms = (t_first - t0) * 1000
            elapsed = time.perf_counter() - t_first
            if stats.new_tokens > 1 and elapsed > 0:
                stats.decode_tps = (stats.new_tokens - 1) / elapsed
