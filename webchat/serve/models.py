"""Several models in one server (issue 22): the catalog, which of them are loaded, and the device thread's driver.

    catalog  = --model (the default) + every model folder and .gguf file in --models-dir, described without loading
    use(M)   → M loaded? its Runtime : load it on the device thread (a .gguf converted once first), after unloading
               the least recently used idle model while more than --max-models would be loaded or the estimates
               would pass --memory-budget; refused before loading, with the estimate, when M alone passes the budget
    admission: one load decided and run at a time (a lock); a load in progress counts against both limits, so
               requests racing for models not loaded wait their turn, and are refused (model_busy) when the models
               in memory are all in use; a model handed to a request is claimed until its job is submitted
    Fleet    = the Backend the front ends submit to: one Worker per loaded model, a job routed by its `model`, and
               the device thread's driver stepping the workers with work in turn (one engine step each)

Sessions (an engine owner per connection), prefix pages and speculative drafts are a model's own: they live in its
Worker and Engine and go when it is unloaded. A load reads (and converts) the model on a side thread at lower priority
with one OpenMP thread (webchat.serve.side), beside the other models' streams; its warm-up forwards then run on the
device thread one at a time between their steps, so no stream waits longer than one verify forward of the new model.
A client may cause LOADS_PER_WINDOW loads a minute (`load_limit` past that).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from webchat.engine import events as ev
from webchat.serve import thinking
from webchat.serve.backend import Job, Snapshot
from webchat.serve.catalog import Card, describe, kv_bytes, scan
from webchat.serve.config import ServerConfig
from webchat.serve.device import DeviceThread
from webchat.serve.runtime import Runtime
from webchat.serve.side import SideThread
from webchat.serve.worker import Worker

__all__ = ["Card", "Fleet", "ModelError", "Models", "describe", "kv_bytes", "scan"]

log = logging.getLogger("webchat.serve.models")

MIB = 1 << 20
CLAIM_S = 10.0  # a model handed to a request stays loaded this long at most while the request prepares its job
LOADS_PER_WINDOW = 4  # loads one client may cause within LOAD_WINDOW_S (a load costs every stream some pace)
LOAD_WINDOW_S = 60.0


class ModelError(Exception):
    """A model that cannot be used now: `code` unknown_model | model_too_large | model_busy | model_failed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def memory_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 34


def fmt_bytes(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / MIB:.1f} MiB"


# ---------------------------------------------------------------- the workers on the device thread
class Fleet:
    """The Backend of a local server: one Worker per loaded model, on one device thread (its Driver)."""

    def __init__(self, device: DeviceThread, default: str) -> None:
        self.device, self.default = device, default
        self.workers: dict[str, Worker] = {}
        self._turn = 0
        self.on_submit: Callable[[str], None] | None = None  # told the model of each job submitted (Models.release)

    def add(self, name: str, worker: Worker) -> None:
        with self.device.cond:
            self.workers[name] = worker
            self.device.cond.notify_all()

    def remove(self, name: str) -> Worker | None:
        with self.device.cond:
            worker = self.workers.pop(name, None)
        if worker is not None:
            worker.halt()
        return worker

    # the Backend
    def start(self) -> None:
        self.device.start()
        self.device.drive(self)

    def stop(self, timeout: float = 10.0) -> None:
        for worker in list(self.workers.values()):
            worker.halt()
        self.device.drive(None)
        self.device.stop(timeout)

    def submit(self, job: Job) -> None:
        if self.on_submit is not None:
            self.on_submit(job.model or self.default)
        worker = self.workers.get(job.model or self.default)
        if worker is None:  # unloaded between the front end's use() and now: the front end loads it again
            job.deliver(ev.Failed("model_busy", f"model {job.model!r} was unloaded before the request started; "
                                                "send it again"))
            return
        worker.submit(job)

    def cancel(self, key: Hashable, request_id: str) -> None:
        for worker in list(self.workers.values()):
            worker.cancel(key, request_id)

    def close(self, key: Hashable) -> None:
        for worker in list(self.workers.values()):
            worker.close(key)

    def snapshot(self) -> Snapshot:
        out = Snapshot()
        for worker in list(self.workers.values()):
            snap = worker.snapshot()
            out.active += snap.active
            out.pending += snap.pending
            out.sessions += snap.sessions
        return out

    # the Driver (webchat.serve.device)
    def has_work(self) -> bool:
        return any(w.has_work() for w in self.workers.values())

    def iterate(self) -> None:
        """One engine step of the next model with work, in turn."""
        with self.device.cond:
            workers = list(self.workers.values())
            ready = [w for w in workers if w.has_work()]
        if not ready:
            return
        self._turn += 1
        ready[self._turn % len(ready)].iterate()


# ---------------------------------------------------------------- loading and unloading
@dataclass
class Loaded:
    card: Card
    runtime: Runtime
    estimate: int


class Models:
    """The catalog and the loaded models, least recently used first; every method runs on the event loop."""

    def __init__(self, cards: dict[str, Card], config: ServerConfig, fleet: Fleet,
                 make_worker: Callable[[Runtime], Worker], max_models: int = 2,
                 memory_budget: int | None = None) -> None:  # fmt: skip
        if max_models < 1:
            raise ValueError(f"--max-models must be at least 1, got {max_models}")
        self.cards, self.config, self.fleet, self.make_worker = cards, config, fleet, make_worker
        self.default = next(name for name, card in cards.items() if card.default)
        self.max_models = max_models
        self.budget = memory_budget if memory_budget is not None else int(memory_total() * 0.8)
        self.loaded: OrderedDict[str, Loaded] = OrderedDict()
        self.loading: dict[str, int] = {}  # a load in progress: its estimate
        self._loading: dict[str, asyncio.Task[Loaded]] = {}
        self._admission = asyncio.Lock()  # one decision-and-load at a time
        self._waiting: dict[str, int] = {}  # requests waiting on a model's load
        self._claims: dict[str, list[float]] = {}  # per model: when each claim on it lapses
        self.loader = SideThread("webchat-loader")  # loads run here, beside the device thread (webchat.serve.side)
        self._loads: dict[Hashable, deque[float]] = {}  # per client: when each load it caused began
        if fleet is not None:  # None: estimates only (tests)
            fleet.on_submit = self.release

    def wire(self) -> list[dict[str, Any]]:
        """Each model for hello and /v1/models; the context it is served with (--max-seq-len applied)."""
        out = []
        for name, card in self.cards.items():
            entry = card.wire(name in self.loaded)
            entry["loading"] = name in self.loading
            if name in self.loaded:
                entry["context_length"] = self.loaded[name].runtime.context_length
                tokenizer = self.loaded[name].runtime.tokenizer
                entry["thinking"] = None if tokenizer is None else thinking.wire(tokenizer)
            elif card.context_length is not None and self.config.max_seq_len is not None:
                entry["context_length"] = min(card.context_length, self.config.max_seq_len)
            out.append(entry)
        return out

    def estimate(self, card: Card) -> tuple[int, int]:
        """(weights, KV pool) bytes: the weight files it runs from (a .gguf's size before its conversion) and the
        KV pool --kv-pool gives it (a pool given in tokens: that many tokens of this model's k and v as --kv-cache
        stores them; the default size when the model's shape is unknown)."""
        from webchat.model.kv_cache import CPU_POOL_BYTES, pool_spec
        from webchat.model.kv_format import share_of_f32

        pool, tokens = pool_spec(self.config.kv_pool or "")
        if pool is None:
            share = share_of_f32(self.config.kv_cache or "f32")  # card.kv_per_token counts float32 rows
            pool = int(tokens * card.kv_per_token * share) if tokens and card.kv_per_token else CPU_POOL_BYTES
        return card.size_bytes, pool

    def attach(self, runtime: Runtime) -> None:
        """The default model, loaded by the lifespan."""
        card = self.cards[self.default]
        worker = self.make_worker(runtime)
        self.fleet.add(card.name, worker)
        self.loaded[card.name] = Loaded(card, runtime, sum(self.estimate(card)))

    def runtime(self, name: str | None = None) -> Runtime:
        """A loaded model's runtime (the default's when None); KeyError if it is not loaded."""
        return self.loaded[name or self.default].runtime

    def check(self, name: str | None) -> str:
        """The name a request asks for, known to the catalog; ModelError naming the ones there are."""
        name = name or self.default
        if name not in self.cards:
            raise ModelError("unknown_model", f"model {name!r} is not served here; the models are {list(self.cards)}")
        return name

    async def use(self, name: str | None, progress: Callable[[dict[str, Any]], None] | None = None,
                  client: Hashable = None) -> Runtime:  # fmt: skip
        """The model's runtime, loaded first if it is not (`progress` hears `loading`, then `loaded`). The model is
        claimed for the caller until its job is submitted (or CLAIM_S passes): no other load unloads it meanwhile.
        A client that has caused LOADS_PER_WINDOW loads in the last LOAD_WINDOW_S is refused another (`load_limit`)."""
        name = self.check(name)
        if name in self.loaded:
            self.loaded.move_to_end(name)
            self._claim(name)
            return self.loaded[name].runtime
        card = self.cards[name]
        if name not in self._loading:
            self._count_load(client, name)
        weights, pool = self.estimate(card)
        if weights + pool > self.budget:
            raise ModelError("model_too_large", (
                f"model {name!r} needs about {fmt_bytes(weights + pool)} (weights {fmt_bytes(weights)}, KV pool "
                f"{fmt_bytes(pool)}); the memory budget is {fmt_bytes(self.budget)} (--memory-budget); it was not "
                "loaded"))
        task = self._loading.get(name)
        if task is None:
            task = self._loading[name] = asyncio.get_running_loop().create_task(self._load(card, weights + pool))
            task.add_done_callback(lambda _: self._loading.pop(name, None))
        self._waiting[name] = self._waiting.get(name, 0) + 1  # each gets its claim when the load ends
        if progress is not None:
            progress({"model": name, "state": "loading", "size_bytes": card.size_bytes,
                      "estimate_bytes": weights + pool})
        t0 = time.perf_counter()
        loaded = await asyncio.shield(task)
        if progress is not None:
            progress({"model": name, "state": "loaded", "seconds": round(time.perf_counter() - t0, 3),
                      "loaded": list(self.loaded)})
        return loaded.runtime

    def _count_load(self, client: Hashable, name: str) -> None:
        """One more load caused by `client`; ModelError(load_limit) past LOADS_PER_WINDOW in LOAD_WINDOW_S."""
        now = time.monotonic()
        times = self._loads.setdefault(client, deque())
        while times and now - times[0] > LOAD_WINDOW_S:
            times.popleft()
        if len(times) >= LOADS_PER_WINDOW:
            wait = LOAD_WINDOW_S - (now - times[0])
            raise ModelError("load_limit", (
                f"model {name!r} is not loaded, and this client has had {len(times)} models loaded in the last "
                f"{LOAD_WINDOW_S:g} s (at most {LOADS_PER_WINDOW}); use a loaded model {list(self.loaded)}, or send it "
                f"again in {wait:.0f} s"))
        times.append(now)
        if len(self._loads) > 4096:  # clients long gone
            for key in [k for k, v in self._loads.items() if not v or now - v[-1] > LOAD_WINDOW_S]:
                del self._loads[key]

    async def _load(self, card: Card, need: int) -> Loaded:
        """One load at a time: room is made and the load counted (`loading`) under the admission lock, so loads in
        progress count against --max-models and --memory-budget from the moment they are decided."""
        async with self._admission:
            try:
                return await self._load_admitted(card, need)
            finally:
                waiting = self._waiting.pop(card.name, 0)
                if card.name in self.loaded:
                    for _ in range(waiting):
                        self._claim(card.name)

    async def _load_admitted(self, card: Card, need: int) -> Loaded:
        if card.name in self.loaded:  # loaded by an earlier holder of the lock
            return self.loaded[card.name]
        self._make_room(card.name, need)
        from webchat.serve.runtime import load_runtime, prepare_grammars, warm_up_beside

        def load() -> Runtime:
            folder = card.path
            if folder.suffix == ".gguf":
                from webchat.files.gguf_cache import model_folder

                folder = model_folder(folder)  # hashed and converted once, into the cache
            runtime = load_runtime(dataclasses.replace(self.config, model_dir=folder, draft_dir=None,
                                                       mmproj=card.projector))
            prepare_grammars(runtime)
            return runtime

        t0 = time.perf_counter()
        self.loading[card.name] = need
        try:  # read and converted beside the streams; warmed a forward at a time between their steps
            runtime = await self.loader.run(load)
            await warm_up_beside(runtime, self.fleet.device.run)
        except Exception as exc:
            if isinstance(exc, OSError | ValueError):  # a bad file: its error says what is wrong
                log.warning("loading model %r failed: %s", card.name, exc)
                message = str(exc)
            else:
                log.exception("loading model %r failed", card.name)
                message = f"{type(exc).__name__}: {exc}"
            raise ModelError("model_failed", f"model {card.name!r} could not be loaded: {message}") from None
        finally:
            self.loading.pop(card.name, None)
        runtime.model_name = card.name
        log.info("model %r loaded in %.1f s", card.name, time.perf_counter() - t0)
        self.fleet.add(card.name, self.make_worker(runtime))
        loaded = self.loaded[card.name] = Loaded(card, runtime, need)
        return loaded

    def _make_room(self, name: str, need: int) -> None:
        """Unload idle models, least recently used first, until `name` fits the count and the budget beside the
        loaded models and any load in progress."""
        while (len(self.loaded) + len(self.loading) >= self.max_models
               or self.in_memory() + need > self.budget):  # fmt: skip
            idle = next((n for n in self.loaded if self._idle(n)), None)
            if idle is None:
                busy = list(self.loaded) + [f"{n} (loading)" for n in self.loading]
                raise ModelError("model_busy", (
                    f"model {name!r} cannot be loaded now: the models {busy} are all in use "
                    f"(at most {self.max_models} loaded, --max-models; memory budget {fmt_bytes(self.budget)}); "
                    "send it again when a reply has ended"))
            self.unload(idle)

    def in_memory(self) -> int:
        """The estimates of the loaded models and of the loads in progress, in bytes."""
        return sum(m.estimate for m in self.loaded.values()) + sum(self.loading.values())

    def _claim(self, name: str) -> None:
        self._claims.setdefault(name, []).append(time.monotonic() + CLAIM_S)

    def release(self, name: str) -> None:
        """A job for `name` was submitted (the Fleet calls this): one claim on it ends."""
        claims = self._claims.get(name)
        if claims:
            claims.pop(0)

    def _idle(self, name: str) -> bool:
        now = time.monotonic()
        claims = self._claims[name] = [t for t in self._claims.get(name, []) if t > now]
        if claims:
            return False
        worker = self.fleet.workers.get(name)
        if worker is None:
            return True
        snap = worker.snapshot()
        return not snap.active and not snap.pending

    def unload(self, name: str) -> None:
        loaded = self.loaded.pop(name)
        worker = self.fleet.remove(name)
        if worker is not None and loaded.runtime.engine is not None:
            engine = loaded.runtime.engine
            self.fleet.device.call(engine.reset)  # its pages go back on the device thread, between steps
        log.info("model %r unloaded (least recently used, idle)", name)
        del loaded
        gc.collect()
