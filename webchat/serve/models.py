"""Several models in one server (issue 22): the catalog, which of them are loaded, and the device thread's driver.

    catalog  = --model (the default) + every model folder and .gguf file in --models-dir, described without loading
    use(M)   → M loaded? its Runtime : load it on the device thread (a .gguf converted once first), after unloading
               the least recently used idle model while more than --max-models would be loaded or the estimates
               would pass --memory-budget; refused before loading, with the estimate, when M alone passes the budget
    Fleet    = the Backend the front ends submit to: one Worker per loaded model, a job routed by its `model`, and
               the device thread's driver stepping the workers with work in turn (one engine step each)

Sessions (an engine owner per connection), prefix pages and speculative drafts are a model's own: they live in its
Worker and Engine and go when it is unloaded. Loading runs on the device thread like every other parallel CPU job
(webchat.serve.device), so the other models' streams pause while a model loads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import os
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from webchat.engine import events as ev
from webchat.gguf_path import model_name
from webchat.serve import thinking
from webchat.serve.backend import Job, Snapshot
from webchat.serve.config import ServerConfig
from webchat.serve.device import DeviceThread
from webchat.serve.runtime import Runtime
from webchat.serve.worker import Worker

log = logging.getLogger("webchat.serve.models")

MIB = 1 << 20


class ModelError(Exception):
    """A model that cannot be used now: `code` unknown_model | model_too_large | model_busy | model_failed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Card:
    """A model in the catalog, described from its files without loading it."""

    name: str
    path: Path  # a model folder or a .gguf file
    size_bytes: int  # the weight files it runs from
    architecture: str
    weights: str  # the commonest weight format: "q4_1", "q4_k", "float32", ...
    context_length: int | None
    default: bool = False
    kv_per_token: int | None = None  # bytes of k and v a token takes in a float32 pool; None: shape unknown

    def wire(self, loaded: bool) -> dict[str, Any]:
        return {"name": self.name, "size_bytes": self.size_bytes, "architecture": self.architecture,
                "weights": self.weights, "context_length": self.context_length, "default": self.default,
                "loaded": loaded}


def _safetensors_metadata(path: Path) -> dict[str, str]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.get("__metadata__") or {}
    return meta if isinstance(meta, dict) else {}


def describe(path: Path, default: bool = False) -> Card:
    """A folder (config.json, its safetensors) or a .gguf (its metadata and tensor types); ValueError if neither."""
    if path.is_file() and path.suffix == ".gguf":
        from gguf import GGUFReader

        reader = GGUFReader(path)

        def field(key: str) -> Any:
            f = reader.fields.get(key)
            return None if f is None else f.contents()

        arch = str(field("general.architecture") or "unknown")
        kinds = Counter(t.tensor_type.name.lower() for t in reader.tensors if len(t.shape) > 1)
        ctx = field(f"{arch}.context_length")
        heads = field(f"{arch}.attention.head_count")
        kv = kv_bytes(field(f"{arch}.block_count"), field(f"{arch}.attention.head_count_kv") or heads,
                      field(f"{arch}.attention.key_length") or _div(field(f"{arch}.embedding_length"), heads),
                      field(f"{arch}.attention.value_length") or _div(field(f"{arch}.embedding_length"), heads))
        return Card(path.stem, path, path.stat().st_size, arch, kinds.most_common(1)[0][0] if kinds else "unknown",
                    int(ctx) if isinstance(ctx, int) else None, default, kv)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path}: neither a model folder (config.json) nor a .gguf file")
    cfg = json.loads(config.read_text())
    arch = (cfg.get("architectures") or ["unknown"])[0]
    quantized = path / "quantized.safetensors"
    if quantized.is_file():
        kinds = Counter(json.loads(_safetensors_metadata(quantized).get("webchat.model.quant", "{}")).values())
        weights = kinds.most_common(1)[0][0] if kinds else "quantized"
        size = quantized.stat().st_size
    else:
        weights = str(cfg.get("torch_dtype") or "float32")
        size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    ctx = cfg.get("max_position_embeddings")
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or _div(cfg.get("hidden_size"), heads)
    kv = kv_bytes(cfg.get("num_hidden_layers"), cfg.get("num_key_value_heads") or heads, head_dim, head_dim)
    return Card(model_name(path), path, size, str(arch), weights, ctx if isinstance(ctx, int) else None, default, kv)


def _div(a: Any, b: Any) -> int | None:
    return a // b if isinstance(a, int) and isinstance(b, int) and b > 0 else None


def kv_bytes(layers: Any, kv_heads: Any, key_len: Any, value_len: Any) -> int | None:
    """Float32 bytes of one token's k and v over all layers (kv_cache.kv_bytes_per_token's count from a model's
    metadata); a per-layer list of kv heads (some GGUFs) counts each layer's own; None when a figure is missing."""
    if isinstance(kv_heads, list):
        kv_heads = sum(int(h) for h in kv_heads) / len(kv_heads) if kv_heads else None
    if not all(isinstance(v, (int, float)) and v > 0 for v in (layers, kv_heads, key_len, value_len)):
        return None
    return int(4 * layers * kv_heads * (key_len + value_len))


def scan(default: Path, models_dir: Path | None) -> dict[str, Card]:
    """The default model first, then each model folder and .gguf in models_dir (by name; a name seen first wins,
    and the default's own folder is not listed twice). Unreadable entries are logged and left out."""
    cards = {(card := describe(default, default=True)).name: card}
    seen = {default.resolve()}
    if models_dir is not None and models_dir.is_dir():
        for path in sorted(models_dir.iterdir()):
            if path.resolve() in seen or path.name.startswith("."):
                continue
            if not (path.is_dir() and (path / "config.json").is_file()) and path.suffix != ".gguf":
                continue
            try:
                card = describe(path)
            except Exception as exc:  # a broken file must not stop the server: it is named and skipped
                log.warning("models dir: %s left out: %s: %s", path, type(exc).__name__, exc)
                continue
            if card.name in cards:  # the default's .gguf itself, or another file of the same name
                log.info("models dir: %s left out: the name %r is %s's", path, card.name, cards[card.name].path)
                continue
            cards[card.name] = card
    return cards


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
        self._loading: dict[str, asyncio.Task[Loaded]] = {}

    def wire(self) -> list[dict[str, Any]]:
        """Each model for hello and /v1/models; the context it is served with (--max-seq-len applied)."""
        out = []
        for name, card in self.cards.items():
            entry = card.wire(name in self.loaded)
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
        KV pool --kv-pool gives it (a pool given in tokens: that many tokens of this model's float32 k and v; the
        default size when the model's shape is unknown)."""
        from webchat.model.kv_cache import CPU_POOL_BYTES, pool_spec

        pool, tokens = pool_spec(self.config.kv_pool or "")
        if pool is None:
            pool = tokens * card.kv_per_token if tokens and card.kv_per_token else CPU_POOL_BYTES
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

    async def use(self, name: str | None, progress: Callable[[dict[str, Any]], None] | None = None) -> Runtime:
        """The model's runtime, loaded first if it is not (`progress` hears `loading`, then `loaded`)."""
        name = self.check(name)
        if name in self.loaded:
            self.loaded.move_to_end(name)
            return self.loaded[name].runtime
        card = self.cards[name]
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
        if progress is not None:
            progress({"model": name, "state": "loading", "size_bytes": card.size_bytes,
                      "estimate_bytes": weights + pool})
        t0 = time.perf_counter()
        loaded = await asyncio.shield(task)
        if progress is not None:
            progress({"model": name, "state": "loaded", "seconds": round(time.perf_counter() - t0, 3),
                      "loaded": list(self.loaded)})
        return loaded.runtime

    async def _load(self, card: Card, need: int) -> Loaded:
        self._make_room(card.name, need)
        from webchat.serve.runtime import load_runtime, warm_up

        def load() -> Runtime:
            folder = card.path
            if folder.suffix == ".gguf":
                from webchat.gguf_path import model_folder

                folder = model_folder(folder)  # hashed and converted once, into the cache
            return warm_up(load_runtime(dataclasses.replace(self.config, model_dir=folder, draft_dir=None)))

        t0 = time.perf_counter()
        try:
            runtime = await self.fleet.device.run(load)
        except Exception as exc:
            log.exception("loading model %r failed", card.name)
            raise ModelError("model_failed", f"model {card.name!r} could not be loaded: {type(exc).__name__}: "
                                             f"{exc}") from None
        runtime.model_name = card.name
        log.info("model %r loaded in %.1f s", card.name, time.perf_counter() - t0)
        self.fleet.add(card.name, self.make_worker(runtime))
        loaded = self.loaded[card.name] = Loaded(card, runtime, need)
        return loaded

    def _make_room(self, name: str, need: int) -> None:
        """Unload idle models, least recently used first, until `name` fits the count and the budget."""
        while len(self.loaded) >= self.max_models or sum(m.estimate for m in self.loaded.values()) + need > self.budget:
            idle = next((n for n in self.loaded if self._idle(n)), None)
            if idle is None:
                raise ModelError("model_busy", (
                    f"model {name!r} cannot be loaded now: the loaded models {list(self.loaded)} are all in use "
                    f"(at most {self.max_models} loaded, --max-models; memory budget {fmt_bytes(self.budget)}); "
                    "send it again when a reply has ended"))
            self.unload(idle)

    def _idle(self, name: str) -> bool:
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
