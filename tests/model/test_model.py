"""The model runtime on tiny models: incremental decoding, the cache, architectures, and clear refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.tiny import make_tiny_model, make_tiny_weights, tiny_config
from webchat.kernels.backend import load_model
from webchat.model.batch import Batch, make_batch
from webchat.model.config import ModelConfigError
from webchat.model.loader import ModelLoadError


def variant(tmp_path: Path, tiny_model_dir: Path, arch: str, **cfg_changes: Any) -> Path:
    """The tiny model's folder with a changed config, weights regenerated to fit (q/k/v biases for Qwen2)."""
    out = tmp_path / arch
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    model_type = {"MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}.get(arch, "llama")
    cfg.update(architectures=[arch], model_type=model_type, **cfg_changes)
    weights = make_tiny_weights(tiny_config(cfg["vocab_size"]), seed=1)
    if arch == "Qwen2ForCausalLM":
        g = torch.Generator().manual_seed(2)
        for i in range(cfg["num_hidden_layers"]):
            for proj, n in (("q", cfg["num_attention_heads"]), ("k", cfg["num_key_value_heads"]), ("v", 2)):
                rows = n * cfg["head_dim"]
                weights[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(rows, generator=g) * 0.5
    if cfg.get("tie_word_embeddings"):
        del weights["lm_head.weight"]
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def reference_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(ids.unsqueeze(0)).logits[0].float()  # type: ignore[no-any-return]


IDS = torch.tensor([1, 17, 99, 250, 3, 44, 300, 12, 7, 480, 2, 64])


def test_incremental_decoding_matches_one_full_forward(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    ids = IDS.tolist()
    full = model.new_cache(64).feed(model, ids, all_logits=True)
    cache = model.new_cache(64)
    parts = [cache.feed(model, ids[:5], all_logits=True), cache.feed(model, ids[5:8], all_logits=True)]
    parts += [cache.feed(model, ids[i : i + 1]) for i in range(8, 12)]
    assert cache.length == len(IDS)
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-4, rtol=1e-4)
    assert model.new_cache(64).feed(model, ids).shape == (1, model.args.vocab_size)


def test_cache_truncate_rewinds_exactly(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    cache, other = model.new_cache(32), model.new_cache(32)
    ids = IDS.tolist()
    cache.feed(model, ids[:6])
    other.feed(model, ids[:6])
    a = cache.feed(model, ids[6:9], all_logits=True)
    cache.truncate(6)
    b = cache.feed(model, ids[6:9], all_logits=True)
    c = other.feed(model, ids[6:9], all_logits=True)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a, c, atol=0, rtol=0)
    with pytest.raises(ValueError, match="cannot truncate a cache of length 9 to 10"):
        cache.truncate(10)
    with pytest.raises(ValueError, match="24 tokens at position 9 overflow the cache of 32"):
        cache.feed(model, list(range(24)))


def test_forward_writes_every_token_and_returns_the_rows_asked_for(tiny_model_dir: Path) -> None:
    # the model reads positions from the batch and never counts: two sequences in one forward, rows by logit_rows
    model = load_model(tiny_model_dir)
    pool = model.new_pool(64, page_size=4)
    ids = IDS.tolist()
    batch = make_batch([(ids[:7], 0, [1, 2], [-1]), (ids[:3], 0, [3], [0, 1, 2])], page_size=4)
    got = model(batch, pool)
    assert got.shape == (4, model.args.vocab_size) and got.dtype == torch.float32
    alone = model.new_cache(64).feed(model, ids[:7])
    torch.testing.assert_close(got[0:1], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1:], model.new_cache(64).feed(model, ids[:3], all_logits=True), atol=1e-5,
                               rtol=1e-5)


def test_a_batch_makes_its_tensors_from_its_lists_only_when_read(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    pool = model.new_pool(64, page_size=4)
    ids = IDS.tolist()
    batch = make_batch([(ids[:7], 0, [1, 2], [-1]), (ids[:3], 0, [3], [0, 1, 2])], page_size=4, prompt_ends=[7, 3])
    assert batch.rows is not None and "tokens" not in vars(batch)  # nothing made yet
    assert batch.num_tokens == 10 and batch.num_seqs == 2
    assert batch.tokens.tolist() == ids[:7] + ids[:3] and batch.positions.tolist() == [*range(7), *range(3)]
    assert batch.block_tables.tolist() == [[1, 2], [3, 0]] and batch.query_start.dtype == torch.int32
    assert batch.logit_rows.tolist() == [6, 7, 8, 9] and batch.seq_lens.tolist() == [7, 3]
    assert batch.prompt_ends is not None and batch.prompt_ends.tolist() == [7, 3]
    assert vars(batch)["tokens"] is batch.tokens  # made once, then kept
    from_lists = model(make_batch([(ids[:7], 0, [1, 2], [-1]), (ids[:3], 0, [3], [0, 1, 2])], page_size=4,
                                  prompt_ends=[7, 3]), pool)
    tensors = Batch(**{name: getattr(batch, name) for name in Batch.TENSORS}, max_seq_len=batch.max_seq_len)
    assert torch.equal(model(tensors, pool), from_lists)  # the C++ step's two entries: the same bits
    with pytest.raises(ValueError, match="non-empty 1-D tensor"):
        model(Batch(**{**{name: getattr(batch, name) for name in Batch.TENSORS}, "tokens": torch.tensor(5)}), pool)
    with pytest.raises(ValueError, match="missing tokens"):
        Batch(positions=batch.positions)


def test_truncated_model_shares_weights_and_runs(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    draft = model.truncated(1)
    assert draft.args.n_layers == 1 and len(draft.layers) == 1 and len(model.layers) == 2
    assert draft.output.weight.data_ptr() == model.output.weight.data_ptr()
    assert draft.new_cache(32).feed(draft, IDS.tolist(), all_logits=True).shape == (len(IDS), model.args.vocab_size)
    with pytest.raises(ValueError, match=r"n_layers must be in \[1, 2\], got 3"):
        model.truncated(3)


@pytest.mark.parametrize(
    ("arch", "changes"),
    [
        ("LlamaForCausalLM", {}),
        ("LlamaForCausalLM", {"tie_word_embeddings": True}),
        ("MistralForCausalLM", {}),
        ("Qwen2ForCausalLM", {}),
        (
            "LlamaForCausalLM",
            {
                "rope_scaling": {
                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
    ],
    ids=["llama", "llama-tied", "mistral", "qwen2-bias", "llama3-rope"],
)
def test_architectures_match_transformers(tmp_path: Path, tiny_model_dir: Path, arch: str, changes: Any) -> None:
    path = variant(tmp_path, tiny_model_dir, arch, **changes)
    ids = torch.randint(3, 500, (200,), generator=torch.Generator().manual_seed(0))
    model = load_model(path)
    ours = model.new_cache(256).feed(model, ids.tolist(), all_logits=True)
    torch.testing.assert_close(ours, reference_logits(path, ids), atol=1e-4, rtol=1e-4)


def test_unknown_architecture_is_refused_by_name(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = variant(tmp_path, tiny_model_dir, "GPT2LMHeadModel")
    with pytest.raises(ModelConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(path)


def test_missing_and_misshapen_tensors_are_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, path)
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) layers\.1\.feed_forward\.w3\.weight"):
        load_model(path)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \(7, 64\), expected"):
        load_model(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(path)


def test_missing_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model(tmp_path / "does-not-exist")


def test_tiny_model_is_made_in_a_fresh_folder(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "t")
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names


def test_transformers5_rope_parameters_are_read() -> None:
    from webchat.model.config import ModelArgs

    cfg = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 512,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }
    args = ModelArgs.from_dict(cfg)
    assert args.rope_theta == 500000.0
    assert args.rope_scaling is not None and args.rope_scaling["rope_type"] == "llama3"
