"""What the lifespan loads once: the model, its tokenizer, the engine, and how to describe them (`hello`); or, with
--engine-url, the remote engine and its probed capabilities (RemoteRuntime: no model, no tokenizer)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from collections.abc import Generator as Steps
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from webchat.engine.spec.drafters import MODES
from webchat.files.gguf_cache import model_name
from webchat.serve import protocol as p
from webchat.serve import thinking
from webchat.serve.config import ServerConfig
from webchat.serve.images import Vision
from webchat.serve.requests import LocalPreparer, Preparer

if TYPE_CHECKING:
    from webchat.engine.engine import Engine
    from webchat.engine.generator import Generator
    from webchat.model.transformer import Transformer
    from webchat.serve.remote.capabilities import Capabilities
    from webchat.serve.remote.engine import RemoteEngine
    from webchat.text.tokenizer import Tokenizer

T = TypeVar("T")

@dataclass
class Runtime:
    """What the lifespan loads once: the model, its tokenizer, an optional draft model, and how to describe them."""

    model: Transformer | None  # None: a remote engine (RemoteRuntime)
    tokenizer: Tokenizer | None
    model_name: str
    device: str
    dtype: str
    context_length: int
    modes: list[str]
    default_mode: str = "none"
    engine: Engine | None = None  # one KV pool and one batched forward for every connection
    weights: str = "float32"  # webchat.model.loader.weights_name: "q4_1", "float32", ...
    precision: str = "exact"  # webchat.model.precision: "exact" (float32 activations), "int8" or "int8x2"
    vision: Vision | None = None  # its projector (--mmproj): the model reads images (webchat.serve.images)

    @property
    def prep(self) -> Preparer:
        """The request path for this model (webchat.serve.requests): template, tokens, grammar, thinking, images."""
        _, tokenizer, _ = self.local()
        assert self.model is not None
        return LocalPreparer(tokenizer, self.model.args.vocab_size, self.context_length, self.default_mode,
                             self.modes, self.vision)

    def local(self) -> tuple[Transformer, Tokenizer, Engine]:
        """The local model, its tokenizer and the engine; a remote runtime has none of them (RuntimeError)."""
        if self.model is None or self.tokenizer is None or self.engine is None:
            raise RuntimeError("generation is upstream (--engine-url): there is no local model")
        return self.model, self.tokenizer, self.engine

    def new_generator(self) -> Generator:
        """A handle on the shared engine that steps it itself (the terminal chat, tests, warm-up; never the server's
        loop, which is webchat.serve.worker's)."""
        from webchat.engine.generator import Generator

        model, tokenizer, engine = self.local()
        return Generator(model, tokenizer, engine=engine)

    def encode_chat(self, messages: list[dict[str, Any]], continue_final: bool = False,
                    prefix_ids: list[int] | None = None, tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:  # fmt: skip
        """The prompt ids: message contents tokenized as text, only the template's markers are control ids.

        prefix_ids: the final (assistant) message as the model's own tokens: the prompt is the rest of the history
        with its generation prompt, then these ids, as when the model produced them (never re-tokenised).
        template_kwargs: the request's chat_template_kwargs; thinking as webchat.serve.thinking encodes it.
        """
        kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        return thinking.encode_chat(self.local()[1], messages, continue_final, prefix_ids, kwargs)

    def hello(self) -> p.Hello:
        return p.Hello(model=self.model_name, context_length=self.context_length, device=self.device,
                       dtype=self.dtype, speculative=list(self.modes), weights=self.weights, precision=self.precision,
                       thinking=None if self.tokenizer is None else thinking.wire(self.tokenizer),
                       vision=None if self.vision is None else self.vision.wire())


def load_runtime(config: ServerConfig) -> Runtime:
    """Load the model (and draft) once onto the configured device."""
    from webchat.files.folder_check import check_model_folder
    from webchat.kernels.backend import load_model
    from webchat.model.loader import resolve_device, resolve_dtype, weights_name
    from webchat.text.tokenizer import Tokenizer

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tokenizer = Tokenizer.from_dir(config.model_dir)  # checked before the weights load
    thinking.wire(tokenizer)  # the template's thinking probed once here, off the event loop (then cached)
    check_model_folder(config.model_dir)
    precision = "exact" if config.exact else None  # None: the faster for the file (webchat.model.precision)
    model = load_model(config.model_dir, device, dtype, weights=config.weights, quantize=config.quantize,
                       precision=precision)
    draft = None
    if config.draft_dir is not None:
        draft = load_model(config.draft_dir, device, dtype, weights=config.weights, quantize=config.quantize,
                           precision=precision)
    if config.kv_cache is not None:  # how the pools store k and v (webchat.model.kv_format), the draft's too
        from webchat.model import kv_format

        if device.type != "cpu":
            raise ValueError(f"--kv-cache {config.kv_cache} runs on the CPU; on {device.type} the KV pool is in "
                             "--dtype (leave --kv-cache out)")
        kv_format.check(config.kv_cache, model.args.head_dim)
        for m in (model, draft):
            if m is not None:
                m.kv_cache = config.kv_cache
    context = min(model.args.max_seq_len, config.max_seq_len or model.args.max_seq_len)
    modes = [m for m in MODES if m != "draft" or draft is not None]
    if config.speculative not in modes:
        raise ValueError(f"--speculative {config.speculative} is not available; choose one of {modes}")
    from webchat.engine.engine import Engine
    from webchat.model.kv_cache import pool_tokens

    engine = Engine(model, tokenizer, max_seq_len=context, draft_model=draft,
                    pool_tokens=pool_tokens(config.kv_pool, model.args, dtype, device, model.kv_cache))
    # a pool smaller than the context (a 3B model's default pool holds ~4,700 tokens at float32) bounds what one
    # conversation may hold: requests past it are told so (prompt_too_long, context_length_exceeded), not failed
    context = min(context, engine.capacity)
    vision = None
    if config.mmproj is not None:
        from webchat.serve.images import load_vision

        vision = load_vision(config.mmproj, model.args.dim, tokenizer, config.mmproj_precision, config.image_max_tiles)
    return Runtime(model=model, tokenizer=tokenizer, model_name=model_name(config.model_dir), device=str(device),
                   dtype=str(dtype).removeprefix("torch."), context_length=context, modes=modes,
                   default_mode=config.speculative, engine=engine, weights=weights_name(model),
                   precision=model.precision, vision=vision)


def warm_up(rt: Runtime) -> Runtime:
    """One short greedy generation, run where the model will be stepped (the device thread): kernels are built and
    the thread's OpenMP team started before the first user waits on them; the cache is left cold. Then, where the
    auto speculative mode is offered, what verify rows cost here is measured (Engine.calibrate)."""
    warm_generation(rt)
    if "auto" in rt.modes:  # what verify rows cost here, for the auto mode's plans (about a second)
        rt.local()[2].calibrate()
    prepare_grammars(rt)
    return rt


def prepare_grammars(rt: Runtime) -> None:
    """The tokenizer's table for grammars (webchat.grammar.matcher) built now, at load: ~0.4 s holding the GIL for
    a 49k vocabulary, which built on the first structured request would pause every stream as long."""
    from webchat.grammar.matcher import grammars_for

    model, tokenizer, _ = rt.local()
    grammars_for(tokenizer, model.args.vocab_size).tokenizer()


class DeviceRun(Protocol):
    """DeviceThread.run: a call awaited on the device thread."""

    def __call__(self, fn: Callable[[], T]) -> Awaitable[T]: ...


async def warm_up_beside(rt: Runtime, device: DeviceRun) -> None:
    """warm_up() for a model loaded while others stream: each forward its own call on the device thread (`device`:
    DeviceThread.run), so the others' steps run between them and none waits longer than one verify forward."""
    await device(lambda: warm_generation(rt))
    if "auto" in rt.modes:
        steps = rt.local()[2].calibration()
        while not (await device(lambda: _advance(steps)))[0]:
            pass


def _advance(steps: Steps[None, None, bool]) -> tuple[bool, bool]:
    """One step of a generator: (ended, its value)."""
    try:
        next(steps)
    except StopIteration as stop:
        return True, bool(stop.value)
    return False, False


def warm_generation(rt: Runtime) -> None:
    """Two greedy tokens of plain text (not the chat template: a template that fails is the requests' error to report,
    never start-up's), the cache left cold."""
    from webchat.engine.sequence import GenerationRequest
    from webchat.engine.settings import SamplingSettings

    _, tokenizer, engine = rt.local()
    gen = rt.new_generator()
    ids = tokenizer.encode_text("Hello, how are you?") or [0]
    gen.begin_stream(GenerationRequest(prompt_ids=ids, settings=SamplingSettings(temperature=0.0), max_new_tokens=2))
    while not gen.stream().eos:
        pass
    close = getattr(gen, "close", None)
    if close is not None:
        close()
    engine.reset()


@dataclass
class RemoteRuntime(Runtime):
    """Generation upstream (webchat.serve.remote): `tokenizer` and `model` are None, `backend` runs the jobs.
    context_length 0 means the upstream did not say."""

    backend: RemoteEngine | None = None  # set by load_remote_runtime

    def new_generator(self) -> Generator:
        raise RuntimeError("a remote engine has no local generator")

    @property
    def prep(self) -> Preparer:
        """The request path on the upstream (webchat.serve.remote.prepare): the chat sent as it is."""
        from webchat.serve.remote.prepare import RemotePreparer

        return RemotePreparer(lambda: self.remote().caps)

    def remote(self) -> RemoteEngine:
        if self.backend is None:
            raise RuntimeError("the remote engine was not set up")
        return self.backend

    def update(self, caps: Capabilities) -> None:
        """A new probe: the served name and context follow it."""
        if caps.model is not None:
            self.model_name = caps.model
        if caps.context_length is not None:
            self.context_length = caps.context_length

    def hello(self) -> p.Hello:
        caps = self.remote().caps
        return p.Hello(model=caps.model or self.model_name, context_length=caps.context_length or 0,
                       device="remote", dtype="remote", speculative=list(self.modes), weights="remote",
                       precision="remote", max_alternatives=caps.max_top_logprobs or p.MAX_ALTERNATIVES,
                       engine=caps.wire(), thinking=caps.thinking,
                       vision={"projector": "upstream"} if caps.images == "accepted" else None)


async def load_remote_runtime(config: ServerConfig) -> RemoteRuntime:
    """Probe the upstream named by --engine-url; an unreachable one is reported (hello, /api/info) and probed again
    at the next request, so the page comes up either way."""
    from webchat.serve.remote.capabilities import detect
    from webchat.serve.remote.client import Upstream
    from webchat.serve.remote.engine import RemoteEngine

    assert config.engine_url is not None
    upstream = Upstream(config.engine_url, config.engine_key, timeout=config.engine_timeout)
    caps = await detect(upstream, config.engine_model)
    backend = RemoteEngine(upstream, caps, config.max_sessions, config.max_queue, want_model=config.engine_model,
                           affinity_header=config.engine_affinity_header)
    rt = RemoteRuntime(model=None, tokenizer=None, model_name=caps.model or config.engine_model or "remote",
                       device="remote", dtype="remote", context_length=caps.context_length or 0, modes=["none"],
                       weights="remote", backend=backend)
    backend.on_caps = rt.update
    return rt
