"""The whole model on the CUDA backend (CudaOps kernels, CUDA graphs): golden output, agreement with the CPU float32
path, reproducible seeded sampling. On machines without a GPU the same kernels run through the CPU emulator
(gpu/emulator.py): the model's use of them, device-side positions included, is checked everywhere; graphs are not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_golden import GOLDEN_GREEDY, GOLDEN_PROMPT, greedy  # tests/ is on sys.path under pytest
from test_kernels import ScalarReads
from webchat.gpu import CudaOps

from webchat.cuda_backend import enable_cuda_backend, run_at
from webchat.generator import GenerationRequest, Generator
from webchat.loader import load_model
from webchat.ops import PagedTorchOps, TorchOps
from webchat.sampling import SamplingSettings
from webchat.tokenizer import Tokenizer

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
# The model now runs ragged batches on a paged pool (webchat.batch, ops.PagedTorchOps); these tests drive the CUDA
# kernels through the model and wait for gpu/'s paged kv_write/paged_attention (issue 10, engineer gpukern).
needs_paged = pytest.mark.skipif(not hasattr(CudaOps, "paged_attention"),
                                 reason="gpu/ has no paged kv_write/paged_attention yet")
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


# ---- anywhere ----


class HostStartOps(TorchOps):
    """TorchOps that also take the position as a one-element tensor, as CudaOps does inside a CUDA graph."""

    @staticmethod
    def kv_append(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: Any) -> None:
        TorchOps.kv_append(cache_k, cache_v, k, v, int(start))

    @staticmethod
    def attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, start: Any) -> torch.Tensor:
        return TorchOps.attention(q, cache_k, cache_v, int(start))


@needs_paged
@pytest.mark.parametrize("backend", ["torch", "emulated"])
def test_device_position_step_matches_forward(tiny_model_dir: Path, backend: str) -> None:
    # what GraphRunner captures (rope rows gathered by a position tensor) computes what forward computes: bit for bit
    # on TorchOps; through the emulated kernels within rounding (attention splits are sized for the whole cache there)
    if backend == "torch":
        model, tol = load_model(tiny_model_dir), 0.0
        model.ops = HostStartOps
    else:
        model, tol = emulated_model(tiny_model_dir), 1e-5
    ref_cache, cache = model.new_cache(64), model.new_cache(64)
    prompt = torch.tensor(GOLDEN_PROMPT)
    ref = model(prompt, ref_cache)
    got = run_at(model, prompt, torch.tensor([0], dtype=torch.int32), cache, last_only=False)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    x = torch.tensor([int(ref[-1].argmax())])
    for pos in range(len(GOLDEN_PROMPT), len(GOLDEN_PROMPT) + 4):
        ref_step = model(x, ref_cache, last_only=True)
        step = run_at(model, x, torch.tensor([pos], dtype=torch.int32), cache, last_only=True)
        torch.testing.assert_close(step, ref_step, rtol=tol, atol=tol)
        x = torch.tensor([int(ref_step[-1].argmax())])
    n = len(GOLDEN_PROMPT) + 4
    for a, b in zip(cache.k + cache.v, ref_cache.k + ref_cache.v, strict=True):
        torch.testing.assert_close(a[:, :n], b[:, :n], rtol=tol, atol=tol)


def test_cpu_models_stay_on_torch_ops(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    assert enable_cuda_backend(model) is False
    assert isinstance(model.ops, PagedTorchOps) and model.runner is None


# ---- anywhere: the kernels in the CPU emulator, driven by the model ----


def emulated_model(path: Path) -> Any:
    from webchat.gpu import CudaOps
    from webchat.gpu.emulator import EmulatorUnavailable, emulated_launcher

    model = load_model(path)
    try:
        model.ops = CudaOps("cpu", launcher=emulated_launcher(), n_sm=132)
    except EmulatorUnavailable as e:
        pytest.skip(f"the kernel emulator cannot run here: {e}")
    return model


@needs_paged
def test_tiny_golden_greedy_through_the_emulated_kernels(tiny_model_dir: Path) -> None:
    model = emulated_model(tiny_model_dir)
    assert greedy(model, GOLDEN_PROMPT, len(GOLDEN_GREEDY)) == GOLDEN_GREEDY


@needs_paged
@pytest.mark.parametrize(("n_tokens", "last_only"), [(1, True), (4, True), (4, False)])
def test_graph_step_reads_no_scalar_on_the_host(tiny_model_dir: Path, n_tokens: int, last_only: bool) -> None:
    # a read (item(), indexing with a 0-d tensor) inside the captured step would fail the CUDA graph capture
    model = emulated_model(tiny_model_dir)
    cache = model.new_cache(64)
    model(torch.tensor(GOLDEN_PROMPT), cache)
    pos = torch.tensor([len(GOLDEN_PROMPT)], dtype=torch.int32)
    with ScalarReads() as mode:
        run_at(model, torch.tensor([5] * n_tokens), pos, cache, last_only=last_only)
    assert mode.reads == []


@needs_paged
@pytest.mark.parametrize("mode", ["self", "ngram"])
def test_speculative_verify_through_the_emulated_kernels_keeps_greedy_output(tiny_model_dir: Path, mode: str) -> None:
    model = emulated_model(tiny_model_dir)
    tok = Tokenizer.from_dir(tiny_model_dir)
    spec = run_ids(Generator(model, tok), prompt_ids=GOLDEN_PROMPT, settings=SamplingSettings(temperature=0.0),
                   max_new_tokens=32, stop_token_ids=[], speculative=mode)  # fmt: skip
    assert spec == GOLDEN_GREEDY


@needs_paged
@pytest.mark.real_model
def test_default_model_greedy_through_the_emulated_kernels_matches_cpu_float32(real_model_dir: Path) -> None:
    # the GPU acceptance check below, on two prompts and fewer tokens: the emulator takes ~0.3 s a token
    tok = Tokenizer.from_dir(real_model_dir)
    cpu, emulated = load_model(real_model_dir), emulated_model(real_model_dir)
    for text in PROMPTS[:2]:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        want, got = greedy(cpu, ids, 24), greedy(emulated, ids, 24)
        assert got == want, f"{text!r}: emulated kernels and CPU float32 differ: {got} vs {want}"


# ---- on the GPU ----


@needs_paged
@pytest.mark.gpu
@needs_gpu
def test_tiny_golden_greedy_on_the_cuda_backend_with_graphs(tiny_model_dir: Path) -> None:
    model = cuda_model(tiny_model_dir, torch.float32)
    assert greedy(model, GOLDEN_PROMPT, len(GOLDEN_GREEDY)) == GOLDEN_GREEDY
    assert model.runner.captures >= 2  # the 6-token prompt and the 1-token step
    assert model.runner.replays >= len(GOLDEN_GREEDY) - 2


@needs_paged
@pytest.mark.gpu
@needs_gpu
def test_graphs_match_eager_kernels_and_torch_ops(tiny_model_dir: Path) -> None:
    model = cuda_model(tiny_model_dir, torch.float16)
    tokens = [
        int(t) for t in torch.randint(3, model.args.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    ]
    runs = {}
    for mode in ("graphs", "eager", "torch"):
        if mode == "eager":
            model.runner = None
        if mode == "torch":
            model.ops = TorchOps
        cache = model.new_cache(64)
        model(torch.tensor(tokens[:5], device="cuda"), cache)
        runs[mode] = torch.cat([model(torch.tensor([t], device="cuda"), cache, last_only=True) for t in tokens[5:]])
    torch.testing.assert_close(runs["graphs"], runs["eager"], rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(runs["graphs"], runs["torch"], rtol=2e-2, atol=5e-2)


@needs_paged
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["self", "ngram"])
def test_speculative_verify_steps_keep_greedy_output(tiny_model_dir: Path, mode: str) -> None:
    model = cuda_model(tiny_model_dir, torch.float32)
    tok = Tokenizer.from_dir(tiny_model_dir)
    greedy_settings = SamplingSettings(temperature=0.0)
    plain = run_ids(Generator(model, tok), prompt_ids=GOLDEN_PROMPT, settings=greedy_settings, max_new_tokens=32,
                    stop_token_ids=[])  # fmt: skip
    spec = run_ids(Generator(model, tok), prompt_ids=GOLDEN_PROMPT, settings=greedy_settings, max_new_tokens=32,
                   stop_token_ids=[], speculative=mode)  # fmt: skip
    assert plain == GOLDEN_GREEDY
    assert spec == plain


@needs_paged
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


@needs_paged
@pytest.mark.gpu
@pytest.mark.real_model
@needs_gpu
def test_default_model_first_64_greedy_tokens_match_cpu_float32(real_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(real_model_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    cpu = load_model(real_model_dir)
    gpu = cuda_model(real_model_dir, torch.float32)
    for text, ids in zip(PROMPTS, prompts, strict=True):
        want, got = greedy(cpu, ids, 64), greedy(gpu, ids, 64)
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        assert got == want, f"{text!r}: GPU and CPU float32 greedy tokens differ first at token {first}"
    assert gpu.runner.replays > 0
