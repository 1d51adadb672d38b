"""Each architecture exact to transformers: a tiny random model from a transformers config, run by webchat from its
folder, greedy tokens and float32 logits against the reference over a prompt and 16 decoded tokens, alone and in a
ragged batch of two rows of different lengths."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from webchat.kernels.backend import load_model
from webchat.kernels.cpu.step import cpu_step_declines
from webchat.kernels.cuda.graphs import cuda_declines
from webchat.model.batch import make_batch
from webchat.model.config import ModelArgs
from webchat.model.kv_cache import PageTable
from webchat.model.transformer import Transformer

transformers = pytest.importorskip("transformers", reason="transformers (the reference) is not installed")

VOCAB, DECODE, TOL = 96, 16, 1e-4
SHAPE: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Gemma's defaults made small enough to matter within 30 tokens: windows of 5, caps the random logits reach
GEMMA: dict[str, Any] = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5)
CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE, head_dim=16),
    "llama3": lambda: transformers.LlamaConfig(
        **SHAPE, head_dim=16, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, head_dim=16),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),
    "mistral-window": lambda: transformers.MistralConfig(**SHAPE, head_dim=16, sliding_window=5),
    "phi3-window": lambda: transformers.Phi3Config(**SHAPE, sliding_window=5),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=16),
    "phi3": lambda: transformers.Phi3Config(**SHAPE),
    "gemma2": lambda: transformers.Gemma2Config(
        **SHAPE, **GEMMA, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SHAPE, **GEMMA, final_logit_softcapping=None, attn_logit_softcapping=None,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}),
}
ARCHS = {"llama": "LlamaForCausalLM", "llama3": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "mistral-window": "MistralForCausalLM", "phi3-window": "Phi3ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
         "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}



def make_reference(kind: str, folder: Path) -> Any:
    """A random float32 model of this kind saved to folder; norms perturbed so Gemma's 1 + w is exercised."""
    return random_model(CONFIGS[kind](), folder)


def random_model(config: Any, folder: Path) -> Any:
    torch.manual_seed(0)
    config.initializer_range = 0.2
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Transformer]:
    kind: str = request.param
    folder = tmp_path_factory.mktemp(kind)
    reference = make_reference(kind, folder)
    return kind, reference, load_model(folder, dtype=torch.float32)


@pytest.fixture(params=["cpp", "torch"])
def path(request: pytest.FixtureRequest, pair: tuple[str, Any, Transformer]) -> Iterator[str]:
    """cpp: the model as it loads (the C++ forward where it runs); torch: the same model on PyTorch ops."""
    model, runner = pair[2], pair[2].runner
    if request.param == "torch":
        model.runner = None
    yield request.param
    model.runner = runner


def runs(model: Transformer) -> int:
    """Forwards the C++ step has run so far (0 on PyTorch ops)."""
    return int(getattr(model.runner, "calls", 0))


def reference_logits(reference: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = reference(torch.tensor([ids])).logits[0].float()
    return out


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def check(kind: str, reference: Any, ids: list[int], got: torch.Tensor, n_prompt: int) -> None:
    """got: our logits at every position of ids but the last; ids[n_prompt:] our greedy tokens."""
    want = reference_logits(reference, ids[:-1])
    delta = (got - want).abs().max().item()
    assert delta <= TOL, f"{kind}: max |Δlogit| {delta:.2e} over {len(ids) - 1} positions"
    assert want[n_prompt - 1 :].argmax(-1).tolist() == ids[n_prompt:], f"{kind}: greedy tokens differ"


def test_config_reads_the_architecture(pair: tuple[str, Any, Transformer]) -> None:
    kind, _, model = pair
    assert model.args.arch == ARCHS[kind]
    # the C++ forward and the CUDA kernels run every one (Phi-3's fused matrices split at load into a Llama block)
    assert cpu_step_declines(model.args) is None and cuda_declines(model.args) is None
    assert model.runner is not None  # the C++ step installed
    unknown = dataclasses.replace(model.args, act="relu")  # something neither runs: both decline, naming it
    assert "relu MLP" in (cpu_step_declines(unknown) or "") and "relu MLP" in (cuda_declines(unknown) or "")


def test_alone_prompt_and_16_decoded_tokens(pair: tuple[str, Any, Transformer], path: str) -> None:
    kind, reference, model = pair
    ids = prompt(11, seed=1)
    before = runs(model)
    cache = model.new_cache(len(ids) + DECODE)
    rows = [cache.feed(model, ids, all_logits=True)]
    n_prompt = len(ids)
    for _ in range(DECODE):
        ids.append(int(rows[-1][-1].argmax()))
        rows.append(cache.feed(model, ids[-1:]))
    check(kind, reference, ids, torch.cat(rows[:-1]), n_prompt)
    assert runs(model) - before == (1 + DECODE if path == "cpp" else 0)  # every forward: the C++ one


def ragged_greedy(model: Transformer, seqs: list[list[int]], decode: int) -> list[torch.Tensor]:
    """The sequences' prompts in one ragged batch, then `decode` greedy steps of all of them together; each sequence
    gets its tokens appended, and its logits at every position but the last come back."""
    pool = model.new_pool(len(seqs) * (max(len(s) for s in seqs) + decode) + 16)
    tables = [PageTable(pool) for _ in seqs]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    new, start = [list(s) for s in seqs], [0] * len(seqs)
    for _ in range(decode):
        for b, table in enumerate(tables):
            table.ensure(start[b] + len(new[b]))
        spec = [(new[b], start[b], tables[b].pages, list(range(len(new[b])))) for b in range(len(seqs))]
        logits = model(make_batch(spec, pool.page_size), pool)
        lo = 0
        for b in range(len(seqs)):
            part = logits[lo : lo + len(new[b])]
            lo += len(new[b])
            got[b].append(part)
            start[b] += len(new[b])
            new[b] = [int(part[-1].argmax())]
            seqs[b].append(new[b][0])
    return [torch.cat(g) for g in got]


def test_batched_two_rows_of_different_lengths(pair: tuple[str, Any, Transformer], path: str) -> None:
    kind, reference, model = pair
    before = runs(model)
    seqs = [prompt(9, seed=2), prompt(14, seed=3)]
    n_prompt = [len(s) for s in seqs]
    got = ragged_greedy(model, seqs, DECODE)
    for b in range(2):
        check(kind, reference, seqs[b], got[b], n_prompt[b])
    assert len(seqs[0]) != len(seqs[1])
    assert runs(model) - before == (DECODE if path == "cpp" else 0)


def test_phi3_refuses_partial_rotary() -> None:
    cfg = CONFIGS["phi3"]().to_dict()
    cfg["architectures"] = ["Phi3ForCausalLM"]
    cfg["rope_parameters"]["partial_rotary_factor"] = 0.75
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelArgs.from_dict(cfg)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_quantized_at_load_matches_its_own_dequantized_weights(pair: tuple[str, Any, Transformer], qtype: str,
                                                                tmp_path: Path) -> None:
    """--quantize on each architecture: the blocks' logits against the same model with the dequantized weights."""
    from webchat.gguf.blocks import dequantize
    from webchat.kernels.cpu import build as qkernels
    from webchat.model.quant import QEmbedding, QLinear

    if qkernels.try_load() is None:
        pytest.skip("the C++ kernels could not be built here (no compiler or ninja)")
    kind, reference, _ = pair
    folder = tmp_path / kind
    reference.save_pretrained(folder)
    quantized = load_model(folder, quantize=qtype, precision="exact")
    dense = load_model(folder, weights="float32")
    swapped = 0
    for name, m in quantized.named_modules():
        if isinstance(m, QLinear | QEmbedding):
            target = dense.get_submodule(name)
            target.weight = torch.nn.Parameter(dequantize(m.weight, m.qtype), requires_grad=False)
            swapped += 1
    assert swapped >= 7 * quantized.args.n_layers
    dense.runner = None  # the PyTorch path on the dequantized weights
    ids = prompt(11, seed=4)
    got = quantized.new_cache(len(ids)).feed(quantized, ids, all_logits=True)
    want = dense.new_cache(len(ids)).feed(dense, ids, all_logits=True)
    assert (got - want).abs().max().item() <= 1e-3


def test_unsupported_rope_scaling_is_refused_from_the_config() -> None:
    cfg = CONFIGS["phi3"]().to_dict()
    cfg["architectures"] = ["Phi3ForCausalLM"]
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                              "long_factor": [1.0] * 8}
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'longrope'"):
        ModelArgs.from_dict(cfg)
