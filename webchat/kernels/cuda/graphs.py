"""The CUDA backend: CudaOps kernels for the hot ops, and decode-sized ragged batches captured into CUDA graphs keyed
by batch-size buckets, replayed with each step's batch copied into static device tensors.

How it is used: `enable_cuda_backend(model)` (called by whoever loads a model onto a CUDA device) sets `model.ops` to
CudaOps and `model.runner` to a GraphRunner. `Transformer.forward(batch, kv)` offers every step to the runner first:
`model.runner(model, batch, kv) -> logits (R, vocab) | None`; a graph captures `model.layers_forward(batch, kv)`.
A step of B <= 64 sequences with at most MAX_ROWS_PER_SEQ rows each on average (decode: 1 token a sequence;
speculative verify: 1 + k) is padded up to a graph shape (B to 1, 2, 4, ... 64 sequences; rows to a power of two;
block tables to a whole context's pages) and replayed; anything else (prefill chunks, a CPU cache) gets None and runs
eagerly. Padding sequences own no rows and have length 0; padding rows lie past the last sequence, write slot 0 of
page 0 (never handed to a sequence) and read nothing.
Without CuPy (or with WEBCHAT_CUDA_KERNELS=0) the model stays on PyTorch ops, eager, and says so in the log.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from webchat.kernels.cuda.sampler import cuda_sampler
from webchat.model.batch import Batch
from webchat.model.config import BEYOND_LLAMA, ModelArgs
from webchat.model.transformer import PagedKV, Transformer

log = logging.getLogger(__name__)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # sequences per captured step
MAX_ROWS_PER_SEQ = 8  # a step of B sequences is graphed when it has at most 8 B rows (verify: 1 + up to 7 drafts)


@dataclass(frozen=True)
class GraphShape:
    """A captured step's static sizes: sequences (a bucket), rows and block-table width (powers of two)."""

    seqs: int
    rows: int
    pages: int


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def graph_shape(batch: Batch, min_pages: int = 1) -> GraphShape | None:
    """The shape a batch is padded to, or None where it is not a decode-sized step. Block tables are padded to at
    least min_pages (the runner passes a whole context's pages, so one width serves every length)."""
    b, t, r = batch.num_seqs, int(batch.tokens.shape[0]), int(batch.logit_rows.shape[0])
    seqs = next((s for s in BATCH_BUCKETS if s >= b), None)
    if seqs is None or t > MAX_ROWS_PER_SEQ * b:
        return None
    rows = _pow2(max(t, seqs))
    width = int(batch.block_tables.shape[1])
    return GraphShape(seqs, rows, max(min_pages, _pow2(width))) if r <= rows else None


def static_batch(shape: GraphShape, page_size: int, device: torch.device) -> Batch:
    """Zeroed device tensors of a graph's shape; its grid is sized for full block tables (max_seq_len)."""

    def z(*size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype, device=device)

    return Batch(tokens=z(shape.rows, dtype=torch.long), positions=z(shape.rows, dtype=torch.long),
                 slot_mapping=z(shape.rows, dtype=torch.long), query_start=z(shape.seqs + 1, dtype=torch.int32),
                 seq_lens=z(shape.seqs, dtype=torch.int32), block_tables=z(shape.seqs, shape.pages, dtype=torch.int32),
                 logit_rows=z(shape.rows, dtype=torch.long), max_seq_len=shape.pages * page_size)  # fmt: skip


def fill(static: Batch, batch: Batch) -> None:
    """Copy batch into static's leading rows and sequences (device to device, no host read); the rest is padding:
    token 0 at position 0 writing slot 0, past query_start[b] = T; empty sequences of length 0 and table 0."""
    b, t, r, w = batch.num_seqs, batch.tokens.shape[0], batch.logit_rows.shape[0], batch.block_tables.shape[1]
    for dst, src in ((static.tokens, batch.tokens), (static.positions, batch.positions),
                     (static.slot_mapping, batch.slot_mapping), (static.logit_rows, batch.logit_rows)):  # fmt: skip
        dst[: src.shape[0]].copy_(src)
        dst[src.shape[0] :].zero_()
    static.query_start[: b + 1].copy_(batch.query_start)
    static.query_start[b + 1 :].copy_(batch.query_start[b:].expand(static.query_start.shape[0] - b - 1))
    static.seq_lens[:b].copy_(batch.seq_lens)
    static.seq_lens[b:].zero_()
    static.block_tables.zero_()
    static.block_tables[:b, :w].copy_(batch.block_tables)
    assert t <= static.tokens.shape[0] and r <= static.logit_rows.shape[0]


def graphable(model: Transformer, batch: Batch, kv: PagedKV) -> bool:
    """A step the runner replays: a decode-sized Batch on CUDA, with CudaOps (whose kernels read lengths on device)."""
    return (
        batch.tokens.device.type == "cuda"
        and batch.embeds is None  # an image's slots run eagerly
        and bool(kv.k)
        and kv.k[0].device == batch.tokens.device
        and getattr(model.ops, "name", "") == "cuda"
        and graph_shape(batch) is not None
    )


@dataclass
class GraphStep:
    """One captured step: the static batch it reads and the logits (rows, vocab) float32 each replay overwrites."""

    graph: torch.cuda.CUDAGraph
    batch: Batch
    logits: torch.Tensor


class GraphRunner:
    """Captures and replays one model's decode-sized steps by GraphShape; the `model.runner` hook of its forward.

    The graphs share one memory pool and are captured against one cache's tensors and rope tables: a step on other
    tensors drops them all (the engine has one paged pool per model). The thread that owns the device runs them one
    at a time, which is what sharing a pool needs.
    """

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.device: torch.device = model.device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # warm-up and capture
        self.steps: dict[GraphShape, GraphStep] = {}
        self.ptrs: tuple[int, ...] = ()
        self.captures = 0
        self.replays = 0

    def __call__(self, model: Transformer, batch: Batch, kv: PagedKV) -> torch.Tensor | None:
        """Logits (R, vocab) float32 for the batch's logit rows, or None to have the caller run it eagerly."""
        if model is not self.model or not graphable(model, batch, kv):
            return None  # e.g. model.truncated(n): a copy that shares this runner but not its layers
        shape = graph_shape(batch, min_pages=-(-model.args.max_seq_len // kv.k[0].shape[1]))  # a context's pages
        assert shape is not None
        ptrs = tuple(t.data_ptr() for t in (*kv.k, *kv.v, model.rope_cos, model.rope_sin))
        if ptrs != self.ptrs:
            self.steps.clear()
            self.ptrs = ptrs
        step = self.steps.get(shape)
        if step is None:
            step = self.steps[shape] = self._capture(shape, batch, kv)
        fill(step.batch, batch)
        step.graph.replay()
        self.replays += 1
        return step.logits[: batch.logit_rows.shape[0]].clone()  # the next replay overwrites step.logits

    def _capture(self, shape: GraphShape, batch: Batch, kv: PagedKV) -> GraphStep:
        """Run the padded step once for real on the side stream (compiles kernels, warms cuBLAS), then capture it.
        The replay that follows rewrites the same k/v, so the warm-up's writes are harmless."""
        static = static_batch(shape, kv.k[0].shape[1], self.device)
        fill(static, batch)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self.model.layers_forward(static, kv)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            logits = self.model.layers_forward(static, kv)  # recorded, not run: it reads nothing on the host
        current.wait_stream(self.stream)
        self.captures += 1
        return GraphStep(graph, static, logits)


def enable_cuda_backend(model: Transformer, graphs: bool = True) -> bool:
    """Put a model on a CUDA device onto CudaOps (and CUDA graphs); False, with a log line, where it stays on torch."""
    if model.device.type != "cuda":
        return False
    if os.environ.get("WEBCHAT_CUDA_KERNELS", "1") == "0":
        log.info("WEBCHAT_CUDA_KERNELS=0: the model runs on PyTorch ops")
        return False
    reason = cuda_declines(model.args)
    if reason is not None:
        log.info("the CUDA kernels decline, PyTorch ops run the model: %s", reason)
        return False
    from webchat.kernels.cuda import CudaOps, KernelUnavailable

    try:
        model.ops = CudaOps(model.device)
    except KernelUnavailable as e:
        log.warning("CUDA kernels unavailable, the model runs on PyTorch ops: %s", e)
        return False
    # the kernels run windows, caps and Gemma's parts on the device, but no GPU has yet run such a model under graphs:
    # they run eagerly on CudaOps until one has (docs/models.md)
    unchecked = model.args.beyond_llama
    if graphs and unchecked:
        log.info("CUDA graphs off for %s (%s): eager CudaOps", model.args.arch, ", ".join(unchecked))
    model.runner = GraphRunner(model) if graphs and not unchecked else None
    model.sampler_factory = functools.partial(cuda_sampler, device=model.device)
    return True


def cuda_declines(args: ModelArgs) -> str | None:
    """Why CudaOps cannot run this architecture, or None; what a model computes beyond a Llama block turns the CUDA
    graphs off (enable_cuda_backend), not the kernels."""
    extra = [x for x in args.beyond_llama if x not in BEYOND_LLAMA]
    return f"{args.arch or 'this model'} needs {', '.join(extra)}" if extra else None


def disable_cuda_backend(model: Transformer) -> None:
    """Back to plain PyTorch ops, eager (for comparisons)."""
    from webchat.model.ops import PagedTorchOps

    model.ops, model.runner, model.sampler_factory = PagedTorchOps(), None, None
