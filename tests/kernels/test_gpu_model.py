"""The whole model on the CUDA backend (CudaOps kernels, CUDA graphs): golden output, agreement with the CPU float32
path, reproducible seeded sampling. On machines without a GPU the same kernels run through the CPU emulator
(kernels/cuda/emulator.py): the model's use of them, device-side positions included, is checked everywhere; graphs are
not."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from test_golden import GOLDEN_GREEDY, GOLDEN_PROMPT, greedy  # tests/ is on sys.path under pytest
from test_kernels import ScalarReads

from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings
from webchat.engine.spec.verify_cost import VerifyCost
from webchat.kernels.backend import load_model
from webchat.kernels.cuda.graphs import (
    GraphRunner,
    GraphShape,
    enable_cuda_backend,
    fill,
    graph_shape,
    graphable,
    static_batch,
)
from webchat.model.batch import Batch, make_batch
from webchat.model.ops import PagedTorchOps
from webchat.text.tokenizer import Tokenizer

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
]


def cuda_model(path: Path, dtype: torch.dtype) -> Any:
    model = load_model(path, device="cuda", dtype=dtype)
    if getattr(model.ops, "name", "") != "cuda" or model.runner is None:
        pytest.skip("CUDA device present but the CUDA backend is off (CuPy missing?); see the log")
    return model


def run_ids(gen: Generator, **kw: Any) -> list[int]:
    gen.begin_stream(GenerationRequest(**kw))
    ids: list[int] = []
    while True:
        res = gen.stream()
        ids.extend(res.token_ids)
        if res.eos:
            return ids


# ---- anywhere: the batched step a CUDA graph captures, on a paged cache ----


@dataclass
class Pool:
    """A paged KV cache (webchat.kernels.cuda.graphs.PagedKV): per layer (num_pages, page_size, n_kv, hd), pages handed
    out in scrambled order, page 0 never."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int
    free: list[int]

    @classmethod
    def for_model(cls, model: Any, n_pages: int, page_size: int) -> Pool:
        shape = (n_pages, page_size, model.args.n_kv_heads, model.args.head_dim)
        k, v = ([torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.layers] for _ in range(2))
        free = (torch.randperm(n_pages - 1, generator=torch.Generator().manual_seed(n_pages)) + 1).tolist()
        return cls(k, v, page_size, free)


Step = Callable[[Batch, Pool], torch.Tensor]


def paged_greedy(model: Any, prompts: list[list[int]], n: int, step: Step | None = None, chunk: int = 4,
                 page_size: int = 4, forced: list[list[int]] | None = None
                 ) -> list[list[int]]:  # fmt: skip
    """n greedy tokens after each prompt, every sequence in one ragged batch per step: prompts fed in chunks of
    `chunk` rows beside the others' decode rows; with `forced`, forced[i] is fed after prompt i, not the argmax.
    step(batch, pool) -> logits of the batch's logit rows; default model(batch, pool), which offers decode-sized steps
    to the model's runner (CUDA graphs) first."""
    model.ensure_rope(max(len(p) for p in prompts) + n)
    pool = Pool.for_model(model, n_pages=2 + sum(-(-(len(p) + n) // page_size) for p in prompts), page_size=page_size)
    run: Step = step or model
    ids, fed, pages = [list(p) for p in prompts], [0] * len(prompts), [[] for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    while active := [i for i in range(len(prompts)) if len(out[i]) < n]:
        entries = []
        for i in active:
            new = ids[i][fed[i] : fed[i] + chunk]
            while len(pages[i]) * page_size < fed[i] + len(new):
                pages[i].append(pool.free.pop())
            entries.append((new, fed[i], list(pages[i]), [-1]))
        logits = run(make_batch(entries, page_size, model.device), pool)
        for i, (new, *_), row in zip(active, entries, logits, strict=True):
            fed[i] += len(new)
            if fed[i] == len(ids[i]):
                out[i].append(int(row.argmax()))
                ids[i].append(forced[i][len(out[i]) - 1] if forced else out[i][-1])
    return out


OTHER_PROMPTS = [[1, 7, 9, 300, 2, 5, 77, 8, 12, 500, 3], [1, 42, 43]]


def test_batched_paged_steps_keep_the_golden_output_and_each_sequence_alone(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)  # PagedTorchOps
    prompts = [GOLDEN_PROMPT, *OTHER_PROMPTS]
    together = paged_greedy(model, prompts, 12)
    assert together[0] == GOLDEN_GREEDY[:12]
    assert together == [paged_greedy(model, [p], 12, chunk=3, page_size=8)[0] for p in prompts]


def test_cpu_models_stay_off_the_cuda_backend(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    assert enable_cuda_backend(model) is False
    assert isinstance(model.ops, PagedTorchOps) and not isinstance(model.runner, GraphRunner)
    batch = make_batch([([1], 0, [1], [-1])], 4)
    assert not graphable(model, batch, Pool.for_model(model, 4, 4))


@pytest.mark.parametrize(
    ("b", "t", "width", "shape"),
    [(1, 1, 1, GraphShape(1, 1, 1)), (3, 3, 5, GraphShape(4, 4, 8)), (5, 17, 2, GraphShape(8, 32, 2)),
     (64, 64, 512, GraphShape(64, 64, 512)), (3, 24, 1, GraphShape(4, 32, 1)), (3, 25, 1, None), (65, 65, 1, None)],
)  # fmt: skip
def test_graph_shapes_are_buckets(b: int, t: int, width: int, shape: GraphShape | None) -> None:
    rows = [t // b + (i < t % b) for i in range(b)]
    batch = make_batch([([1] * r, 0, [1] * width, [-1]) for r in rows], 1024)
    assert graph_shape(batch) == shape
    # the runner pads tables to a whole context's pages: one width for every length
    assert graph_shape(batch, min_pages=256) == (shape and GraphShape(shape.seqs, shape.rows, max(256, shape.pages)))


# ---- anywhere: the kernels in the CPU emulator, driven by the model ----


def emulated_model(path: Path) -> Any:
    from webchat.kernels.cuda import CudaOps
    from webchat.kernels.cuda.emulator import EmulatorUnavailable, emulated_launcher

    model = load_model(path, precision="exact")  # a GPU's activations are float (int8 is the CPU's path)
    model.runner = None  # else the C++ forward (webchat.kernels.cpu.step) runs the CPU model and no kernel runs
    try:
        model.ops = CudaOps("cpu", launcher=emulated_launcher(), n_sm=132)
    except EmulatorUnavailable as e:
        pytest.skip(f"the kernel emulator cannot run here: {e}")
    return model


def test_tiny_golden_greedy_through_the_emulated_kernels(tiny_model_dir: Path) -> None:
    model = emulated_model(tiny_model_dir)
    assert greedy(model, GOLDEN_PROMPT, len(GOLDEN_GREEDY)) == GOLDEN_GREEDY


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "qwen3", "mistral-window"])
def test_architectures_beyond_llama_through_the_emulated_kernels(tmp_path: Path, kind: str) -> None:
    """Gemma's soft caps, windows, score scale, GELU, post norms and local rope, Qwen3's q/k norms and Mistral's window
    on CudaOps (in the emulator): the same greedy tokens as the PyTorch path, 3 prompts in ragged batches run past the
    windows of 5, and logits within 1e-4 on one batch."""
    from test_archs import make_reference

    from webchat.kernels.cuda import CudaOps

    make_reference(kind, tmp_path / kind)
    model, reference = emulated_model(tmp_path / kind), load_model(tmp_path / kind)
    reference.runner = None
    assert isinstance(model.ops, CudaOps)
    prompts = [[1, 7, 9, 30, 2, 5, 77, 8, 12, 50, 3], [1, 42, 43], [5, 6]]
    assert paged_greedy(model, prompts, 12) == paged_greedy(reference, prompts, 12)
    batch, pool = make_batch([(prompts[0], 0, [1, 2, 3], [0, 5, 10])], 4), Pool.for_model(model, 4, 4)
    ours = model(batch, pool)
    twin = Pool.for_model(reference, 4, 4)
    torch.testing.assert_close(ours, reference(batch, twin), atol=1e-4, rtol=1e-4)


def test_batched_paged_steps_through_the_emulated_kernels(tiny_model_dir: Path) -> None:
    model = emulated_model(tiny_model_dir)
    reference = load_model(tiny_model_dir)  # PagedTorchOps
    prompts = [GOLDEN_PROMPT, *OTHER_PROMPTS]
    got = paged_greedy(model, prompts, 8)
    assert got[0] == GOLDEN_GREEDY[:8]
    assert got == paged_greedy(reference, prompts, 8)


@pytest.mark.parametrize("rows", [(1, 1, 1), (4, 2, 3)])  # decode; verify (1 + k rows, logits of every row)
def test_padded_graph_step_matches_the_batch_and_reads_no_scalar(tiny_model_dir: Path, rows: tuple[int, ...]) -> None:
    # what GraphRunner replays: the batch copied into a bucket's static tensors, padding rows writing to page 0
    model = emulated_model(tiny_model_dir)
    model.ensure_rope(64)
    pool = Pool.for_model(model, n_pages=16, page_size=4)
    lengths = [5, 9, 14]
    tables = [[pool.free.pop() for _ in range(-(-(n + r) // 4))] for n, r in zip(lengths, rows, strict=True)]
    gen = torch.Generator().manual_seed(1)
    model(make_batch([(torch.randint(3, 500, (n,), generator=gen).tolist(), 0, tab, [-1])
                      for n, tab in zip(lengths, tables, strict=True)], 4), pool)  # fmt: skip
    logit_rows = [list(range(r)) if len(set(rows)) > 1 else [-1] for r in rows]
    batch = make_batch([(torch.randint(3, 500, (r,), generator=gen).tolist(), n, tab, lr)
                        for r, n, tab, lr in zip(rows, lengths, tables, logit_rows, strict=True)], 4)  # fmt: skip
    before = [t.clone() for t in pool.k + pool.v]
    want = model(batch, pool)
    after = [t.clone() for t in pool.k + pool.v]
    for t, b in zip(pool.k + pool.v, before, strict=True):
        t.copy_(b)
    shape = graph_shape(batch)
    assert shape is not None and shape.seqs == 4 and shape.rows >= batch.tokens.shape[0]
    static = static_batch(shape, 4, model.device)
    with ScalarReads() as mode:
        fill(static, batch)
        got = model.layers_forward(static, pool)[: batch.logit_rows.shape[0]]
    assert mode.reads == []
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for t, w in zip(pool.k + pool.v, after, strict=True):  # padding changed page 0 only
        torch.testing.assert_close(t[1:], w[1:], rtol=1e-6, atol=1e-6)


def drafting(gen: Generator) -> Generator:
    """The auto mode granting every draft it is offered, whatever the measured costs: every step verifies."""
    gen.engine.auto.cost = VerifyCost.flat()
    return gen


@pytest.mark.parametrize("mode", ["self", "ngram", "auto"])
def test_speculative_verify_through_the_emulated_kernels_keeps_greedy_output(tiny_model_dir: Path, mode: str) -> None:
    model = emulated_model(tiny_model_dir)
    tok = Tokenizer.from_dir(tiny_model_dir)
    spec = run_ids(drafting(Generator(model, tok)), prompt_ids=GOLDEN_PROMPT,
                   settings=SamplingSettings(temperature=0.0), max_new_tokens=32, stop_token_ids=[],
                   speculative=mode)  # fmt: skip
    assert spec == GOLDEN_GREEDY


@pytest.mark.real_model
def test_default_model_greedy_through_the_emulated_kernels_matches_cpu_float32(real_model_dir: Path) -> None:
    # the GPU acceptance check below, on two prompts and fewer tokens: the emulator takes ~0.3 s a token
    tok = Tokenizer.from_dir(real_model_dir)
    cpu, emulated = load_model(real_model_dir, precision="exact"), emulated_model(real_model_dir)
    for text in PROMPTS[:2]:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        want, got = greedy(cpu, ids, 24), greedy(emulated, ids, 24)
        assert got == want, f"{text!r}: emulated kernels and CPU float32 differ: {got} vs {want}"


# ---- on the GPU ----


@pytest.mark.gpu
@needs_gpu
def test_tiny_golden_greedy_on_the_cuda_backend_with_graphs(tiny_model_dir: Path) -> None:
    model = cuda_model(tiny_model_dir, torch.float32)
    got = paged_greedy(model, [GOLDEN_PROMPT, *OTHER_PROMPTS], len(GOLDEN_GREEDY))
    assert got[0] == GOLDEN_GREEDY
    assert model.runner.captures >= 1  # the prompts' chunks and the decode steps of 3 sequences (bucket 4)
    assert model.runner.replays >= len(GOLDEN_GREEDY) - 2


@pytest.mark.gpu
@needs_gpu
def test_graphs_match_eager_kernels_and_torch_ops(tiny_model_dir: Path) -> None:
    model = cuda_model(tiny_model_dir, torch.float16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.args.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 2, 17, 6)]
    forced = [torch.randint(3, model.args.vocab_size, (24,), generator=gen).tolist() for _ in prompts]
    runs = {}
    for mode in ("graphs", "eager", "torch"):
        if mode == "eager":
            model.runner = None
        if mode == "torch":
            model.ops = PagedTorchOps()
        logits: list[torch.Tensor] = []

        def record(batch: Batch, pool: Pool, seen: list[torch.Tensor] = logits, run: Step = model) -> torch.Tensor:
            seen.append(run(batch, pool))
            return seen[-1]

        paged_greedy(model, prompts, 24, step=record, forced=forced)  # the same inputs in every mode
        runs[mode] = torch.cat(logits)
    torch.testing.assert_close(runs["graphs"], runs["eager"], rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(runs["graphs"], runs["torch"], rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["self", "ngram", "auto"])
def test_speculative_verify_steps_keep_greedy_output(tiny_model_dir: Path, mode: str) -> None:
    model = cuda_model(tiny_model_dir, torch.float32)
    tok = Tokenizer.from_dir(tiny_model_dir)
    greedy_settings = SamplingSettings(temperature=0.0)
    plain = run_ids(Generator(model, tok), prompt_ids=GOLDEN_PROMPT, settings=greedy_settings, max_new_tokens=32,
                    stop_token_ids=[])  # fmt: skip
    spec = run_ids(drafting(Generator(model, tok)), prompt_ids=GOLDEN_PROMPT, settings=greedy_settings,
                   max_new_tokens=32, stop_token_ids=[], speculative=mode)  # fmt: skip
    assert plain == GOLDEN_GREEDY
    assert spec == plain


@pytest.mark.gpu
@needs_gpu
def test_seeded_sampling_is_reproducible(tiny_model_dir: Path) -> None:
    model = cuda_model(tiny_model_dir, torch.float16)
    tok = Tokenizer.from_dir(tiny_model_dir)
    settings = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    runs = [run_ids(Generator(model, tok), prompt_ids=GOLDEN_PROMPT, settings=settings, max_new_tokens=48,
                    stop_token_ids=[]) for _ in range(2)]  # fmt: skip
    other = run_ids(Generator(model, tok), prompt_ids=GOLDEN_PROMPT, settings=SamplingSettings(
        temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=4321), max_new_tokens=48, stop_token_ids=[])  # fmt: skip
    assert len(runs[0]) == 48 and runs[0] == runs[1]
    assert other != runs[0]  # the seed matters: 48 draws over a ~500-token vocabulary at temperature 1


@pytest.mark.gpu
@pytest.mark.real_model
@needs_gpu
def test_default_model_first_64_greedy_tokens_match_cpu_float32(real_model_dir: Path) -> None:
    # the five prompts decode together, through the graphs of their batch buckets, as the CPU does them batched
    tok = Tokenizer.from_dir(real_model_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    cpu = load_model(real_model_dir, precision="exact")
    gpu = cuda_model(real_model_dir, torch.float32)
    want = paged_greedy(cpu, prompts, 64, chunk=16, page_size=16)
    got = paged_greedy(gpu, prompts, 64, chunk=16, page_size=16)
    for text, g, w in zip(PROMPTS, got, want, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        assert g == w, f"{text!r}: GPU and CPU float32 greedy tokens differ first at token {first}"
    assert gpu.runner.replays > 0
