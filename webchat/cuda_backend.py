"""The CUDA backend: CudaOps kernels for the hot ops, and small steps (decode, speculative verify) captured once into
CUDA graphs and replayed with the token ids and position in static device tensors.

How it is used: `enable_cuda_backend(model)` (called by whoever loads a model onto a CUDA device) sets `model.ops` to
CudaOps and `model.runner` to a GraphRunner. `Transformer.forward` then offers every call to the runner first:
a step of at most MAX_GRAPH_TOKENS tokens on a CUDA cache is replayed from a graph (captured on its first occurrence,
per cache, token count and last_only), anything else (prefill, a truncated self-draft model) runs eagerly. Callers
see the ordinary `model(tokens, cache, last_only)` contract: fresh float32 logits, cache.length advanced by T.
Without CuPy (or with WEBCHAT_CUDA_KERNELS=0) the model stays on TorchOps, eager, and says so in the log.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)
MAX_GRAPH_TOKENS = 8  # decode (1) and speculative verify (draft tokens + 1) steps


@dataclass
class GraphStep:
    """One captured step: static inputs the graph reads, the logits it writes, what it was captured against."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # (T,) int64, copied into before each replay
    pos: torch.Tensor  # (1,) int32: position of tokens[0]
    logits: torch.Tensor  # (T or 1, vocab) float32, overwritten by each replay
    cache_ptrs: tuple[int, ...]  # data_ptr of every cache tensor at capture
    rope: tuple[torch.Tensor, torch.Tensor]  # the tables the graph indexes (kept alive)


def cache_ptrs(cache: Any) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in cache.k + cache.v)


def graphable(model: Any, tokens: torch.Tensor, cache: Any) -> bool:
    """A step the runner replays: few tokens, on CUDA, with CudaOps (whose kernels read the position on device)."""
    return (
        tokens.shape[0] <= MAX_GRAPH_TOKENS
        and tokens.device.type == "cuda"
        and bool(cache.k)
        and cache.k[0].device == tokens.device
        and getattr(model.ops, "name", "") == "cuda"
    )


def run_at(model: Any, tokens: torch.Tensor, pos: torch.Tensor, cache: Any, last_only: bool) -> torch.Tensor:
    """The step a graph captures: rope rows and cache position come from the device tensor pos (1,) int32."""
    idx = pos.long() + torch.arange(tokens.shape[0], device=pos.device)  # (T,) positions
    rope = (model.rope_cos.index_select(0, idx), model.rope_sin.index_select(0, idx))  # (T, hd/2) each
    logits: torch.Tensor = model.layers_forward(tokens, cache, pos, rope, last_only)
    return logits


class GraphRunner:
    """Captures and replays one model's small steps; the `model.runner` hook of Transformer.forward.

    Graphs are kept per cache (weakly: a dropped cache drops its graphs) and share one memory pool; the worker
    thread that owns the device runs them one at a time, which is what sharing a pool needs.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device: torch.device = model.device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # warm-up and capture
        self.steps: weakref.WeakKeyDictionary[Any, dict[tuple[int, bool], GraphStep]] = weakref.WeakKeyDictionary()
        self.captures = 0
        self.replays = 0

    def __call__(self, model: Any, tokens: torch.Tensor, cache: Any, last_only: bool) -> torch.Tensor | None:
        """Logits for tokens at cache.length.. (advancing cache.length), or None to have the caller run eagerly."""
        if model is not self.model or not graphable(model, tokens, cache):
            return None  # e.g. model.truncated(n): a copy that shares this runner but not its layers
        start, key = cache.length, (tokens.shape[0], last_only)
        per_cache = self.steps.setdefault(cache, {})
        step = per_cache.get(key)
        if step is None or step.cache_ptrs != cache_ptrs(cache):
            step, logits = self._capture(tokens, cache, last_only)
            per_cache[key] = step
        else:
            step.tokens.copy_(tokens)
            step.pos.fill_(start)
            step.graph.replay()
            self.replays += 1
            logits = step.logits.clone()  # the next replay overwrites step.logits
        cache.length = start + tokens.shape[0]
        return logits

    def _capture(self, tokens: torch.Tensor, cache: Any, last_only: bool) -> tuple[GraphStep, torch.Tensor]:
        """Run the step once for real on the side stream (compiles kernels, warms cuBLAS), then capture it."""
        m = self.model
        static_tokens = tokens.detach().clone()
        pos = torch.full((1,), cache.length, dtype=torch.int32, device=self.device)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            logits = run_at(m, static_tokens, pos, cache, last_only)  # this call's answer
        current.wait_stream(self.stream)
        logits.record_stream(current)  # allocated on the side stream, consumed on the current one
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            static_logits = run_at(m, static_tokens, pos, cache, last_only)  # recorded, not run
        self.captures += 1
        step = GraphStep(graph, static_tokens, pos, static_logits, cache_ptrs(cache), (m.rope_cos, m.rope_sin))
        return step, logits


def enable_cuda_backend(model: Any, graphs: bool = True) -> bool:
    """Put a model on a CUDA device onto CudaOps (and CUDA graphs); False, with a log line, where it stays on torch."""
    if model.device.type != "cuda":
        return False
    if os.environ.get("WEBCHAT_CUDA_KERNELS", "1") == "0":
        log.info("WEBCHAT_CUDA_KERNELS=0: the model runs on PyTorch ops")
        return False
    from webchat.gpu import CudaOps, KernelUnavailable

    if not hasattr(CudaOps, "paged_attention"):  # the model runs ragged batches on a paged pool (webchat.batch)
        log.warning("CudaOps has no paged kernels yet: the model runs on PyTorch ops")
        return False
    try:
        model.ops = CudaOps(model.device)
    except KernelUnavailable as e:
        log.warning("CUDA kernels unavailable, the model runs on PyTorch ops: %s", e)
        return False
    model.runner = GraphRunner(model) if graphs else None
    return True


def disable_cuda_backend(model: Any) -> None:
    """Back to plain PyTorch ops, eager (for comparisons)."""
    from webchat.ops import PagedTorchOps

    model.ops, model.runner = PagedTorchOps(), None
