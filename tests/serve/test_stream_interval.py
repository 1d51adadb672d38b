"""The worker's stream interval (webchat.serve.worker): tokens faster than the interval go out several to a message,
the first token and the end at once, and nothing waits behind a prefill, an admission or a slow step."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import pytest

from webchat.engine import events as ev
from webchat.engine.sequence import GenerationRequest, StartInfo, StreamResult
from webchat.serve.backend import Job
from webchat.serve.worker import Worker

pytestmark = pytest.mark.timeout(60)


@dataclass(eq=False)
class FakeSeq:
    tokens: int  # how many it generates
    prefill_steps: int = 0  # steps before its first token
    made: int = 0
    steps: int = 0
    done: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def prefilling(self) -> bool:
        return self.made == 0


class FakeEngine:
    """One token a step for every running sequence past its prefill steps; each step sleeps `step_s`."""

    def __init__(self, step_s: float, plan: list[FakeSeq]) -> None:
        self.step_s, self.plan = step_s, list(plan)
        self.running: list[FakeSeq] = []
        self.outbox: dict[FakeSeq, StreamResult] = {}

    def fits(self, req: GenerationRequest) -> bool:
        return True

    def add(self, owner: object, req: GenerationRequest) -> tuple[FakeSeq, StartInfo]:
        seq = self.plan.pop(0)
        self.running.append(seq)
        return seq, StartInfo(len(req.prompt_ids), 0)

    def step(self) -> None:
        time.sleep(self.step_s)
        for seq in list(self.running):
            seq.steps += 1
            if seq.steps <= seq.prefill_steps:
                continue
            out = StreamResult(text=f"<{seq.made}>", token_ids=[seq.made])
            seq.made += 1
            if seq.made == seq.tokens or seq.cancel.is_set():
                out.eos, out.eos_reason, out.stats = True, "max_new_tokens", ev.Stats()
                seq.done = True
                self.running.remove(seq)
            if seq in self.outbox:
                self.outbox[seq].merge(out)
            else:
                self.outbox[seq] = out

    def take(self, seq: FakeSeq) -> StreamResult | None:
        return self.outbox.pop(seq, None)

    def close(self, owner: object) -> None:
        pass


def run(engine: FakeEngine, interval: float, starts: list[float],
        max_sessions: int = 8) -> list[list[tuple[float, ev.Event]]]:
    """Submit one request per entry of `starts` (seconds after the first), each its own client; every request's
    events with the time each reached the event loop."""
    loop = asyncio.new_event_loop()
    got: list[list[tuple[float, ev.Event]]] = [[] for _ in starts]
    left = len(starts)

    def deliver(i: int):  # type: ignore[no-untyped-def]
        def put(event: ev.Event) -> None:
            nonlocal left
            got[i].append((time.perf_counter(), event))
            if isinstance(event, ev.Finished | ev.Failed):
                left -= 1
                if not left:
                    loop.stop()
        return put

    worker = Worker(engine, str, loop, max_sessions=max_sessions, max_queue=8,  # type: ignore[arg-type]
                    stream_interval=interval)
    worker.start()
    for i, at in enumerate(starts):
        job = Job(key=i, request_id=str(i), request=GenerationRequest([1, 2, 3]), deliver=deliver(i), client=i)
        loop.call_later(at, worker.submit, job)
    loop.call_later(30, loop.stop)
    loop.run_forever()
    worker.stop()
    loop.close()
    assert not left, f"not every request finished: {got}"
    return got


def token_messages(events: list[tuple[float, ev.Event]]) -> list[str]:
    return [e.text for _, e in events if isinstance(e, ev.Tokens)]


def test_fast_tokens_go_out_several_to_a_message_first_and_last_at_once() -> None:
    seq = FakeSeq(tokens=60)
    events = run(FakeEngine(0.002, [seq]), 0.05, [0.0])[0]
    texts = token_messages(events)
    assert "".join(texts) == "".join(f"<{i}>" for i in range(60))  # every token, in order, none twice
    assert texts[0] == "<0>"  # the first token alone, not held for the interval
    assert len(texts) < 30  # ~2 ms a token against 50 ms: several a message
    assert isinstance(events[-1][1], ev.Finished) and texts[-1].endswith("<59>")  # the end with the last tokens


def test_every_step_is_sent_without_an_interval() -> None:
    texts = token_messages(run(FakeEngine(0.002, [FakeSeq(tokens=30)]), 0.0, [0.0])[0])
    assert texts == [f"<{i}>" for i in range(30)]


def test_tokens_slower_than_the_interval_go_out_one_by_one() -> None:
    texts = token_messages(run(FakeEngine(0.03, [FakeSeq(tokens=8)]), 0.01, [0.0])[0])
    assert texts == [f"<{i}>" for i in range(8)]


def test_nothing_is_held_while_another_request_prefills() -> None:
    # a 10-second interval would hold the first stream's tokens to its end; while the second prefills (20 steps) every
    # step's token goes out
    first, second = FakeSeq(tokens=200), FakeSeq(tokens=5, prefill_steps=20)
    got = run(FakeEngine(0.002, [first, second]), 10.0, [0.0, 0.05])
    texts = token_messages(got[0])
    assert "".join(texts) == "".join(f"<{i}>" for i in range(200))
    singles = sum(1 for t in texts if t.count("<") == 1)
    assert singles >= 20, texts  # one message a step through the other's prefill
    assert len(texts) < 60  # and held again once it decodes


def test_a_request_that_cannot_be_admitted_yet_does_not_stop_the_holding() -> None:
    # one slot: the second request waits for the first to end, and no admission can come before it does
    first, second = FakeSeq(tokens=60), FakeSeq(tokens=5)
    got = run(FakeEngine(0.002, [first, second]), 0.05, [0.0, 0.01], max_sessions=1)
    assert len(token_messages(got[0])) < 30
    assert "".join(token_messages(got[1])) == "".join(f"<{i}>" for i in range(5))
