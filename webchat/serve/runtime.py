"""What the lifespan loads once: the model, its tokenizer, the engine, and how to describe them (`hello`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from webchat.engine.speculative import MODES
from webchat.serve import protocol as p
from webchat.serve.config import ServerConfig
from webchat.serve.worker import StreamingGenerator


@dataclass
class Runtime:
    """What the lifespan loads once: the model, its tokenizer, an optional draft model, and how to describe them."""

    model: Any  # webchat.model.transformer.Transformer
    tokenizer: Any  # webchat.text.tokenizer.Tokenizer
    model_name: str
    device: str
    dtype: str
    context_length: int
    modes: list[str]
    draft_model: Any = None
    default_mode: str = "none"
    engine: Any = None  # webchat.engine.engine.Engine: one KV pool and one batched forward for every connection
    weights: str = "float32"  # webchat.model.loader.weights_name: "q4_1", "float32", ...

    def new_generator(self) -> StreamingGenerator:
        from webchat.engine.generator import Generator

        gen: StreamingGenerator = Generator(self.model, self.tokenizer, engine=self.engine)
        return gen

    def encode_chat(self, messages: list[dict[str, str]], continue_final: bool = False) -> list[int]:
        """The prompt ids: message contents tokenized as text, only the template's markers are control ids."""
        ids: list[int] = self.tokenizer.encode_chat(messages, continue_final=continue_final)
        return ids

    def hello(self) -> p.Hello:
        return p.Hello(model=self.model_name, context_length=self.context_length, device=self.device,
                       dtype=self.dtype, speculative=list(self.modes), weights=self.weights)


def load_runtime(config: ServerConfig) -> Runtime:
    """Load the model (and draft) once onto the configured device."""
    from webchat.folder_check import check_model_folder
    from webchat.model.loader import load_model, resolve_device, resolve_dtype, weights_name
    from webchat.text.tokenizer import Tokenizer

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tokenizer = Tokenizer.from_dir(config.model_dir)  # checked before the weights load
    check_model_folder(config.model_dir)
    model = load_model(config.model_dir, device, dtype, weights=config.weights, quantize=config.quantize)
    draft = None
    if config.draft_dir is not None:
        draft = load_model(config.draft_dir, device, dtype, weights=config.weights, quantize=config.quantize)
    context = min(model.args.max_seq_len, config.max_seq_len or model.args.max_seq_len)
    modes = [m for m in MODES if m != "draft" or draft is not None]
    if config.speculative not in modes:
        raise ValueError(f"--speculative {config.speculative} is not available; choose one of {modes}")
    from webchat.engine.engine import Engine
    from webchat.model.kv_cache import pool_tokens

    engine = Engine(model, tokenizer, max_seq_len=context, draft_model=draft,
                    pool_tokens=pool_tokens(config.kv_pool, model.args, dtype, device))
    return Runtime(model=model, tokenizer=tokenizer, model_name=config.model_dir.name, device=str(device),
                   dtype=str(dtype).removeprefix("torch."), context_length=context, modes=modes, draft_model=draft,
                   default_mode=config.speculative, engine=engine, weights=weights_name(model))
