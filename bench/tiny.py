"""A tiny randomly initialised Llama written as an ordinary model folder, for fast tests and golden outputs; and a
tiny Qwen3 with the thinking markers in its vocabulary, for a real Qwen3 chat template (make_tiny_qwen3)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    "Paris is the capital of France. Berlin is the capital of Germany. 1234567890",
    "Café, naïve, über, smörgåsbord — déjà vu. Привет, мир! こんにちは世界。你好，世界！ 🙂🚀🎉",
    "Streaming text appears token by token; a Stop button halts generation mid-stream.",
    "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\nFour.<|im_end|>",
] * 4


def tiny_config(vocab_size: int, max_seq_len: int = 1024) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_seq_len,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def make_tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Byte-level BPE with SmolLM2's pre-tokenizer, trained on a fixed corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def make_tiny_weights(cfg: dict[str, object], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with enough spread that greedy decoding wanders instead of repeating one token."""
    g = torch.Generator().manual_seed(seed)
    dim, ffn, hd = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["head_dim"])  # type: ignore[call-overload]
    n_h, n_kv, vocab = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["vocab_size"])  # type: ignore[call-overload]

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab, dim, scale=1.0)}
    for i in range(int(cfg["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(n_h * hd, dim, scale=dim**-0.5)
        w[p + "self_attn.k_proj.weight"] = rand(n_kv * hd, dim, scale=dim**-0.5)
        w[p + "self_attn.v_proj.weight"] = rand(n_kv * hd, dim, scale=dim**-0.5)
        w[p + "self_attn.o_proj.weight"] = rand(dim, n_h * hd, scale=(n_h * hd) ** -0.5)
        w[p + "mlp.gate_proj.weight"] = rand(ffn, dim, scale=dim**-0.5)
        w[p + "mlp.up_proj.weight"] = rand(ffn, dim, scale=dim**-0.5)
        w[p + "mlp.down_proj.weight"] = rand(dim, ffn, scale=ffn**-0.5)
        w[p + "input_layernorm.weight"] = 1.0 + rand(dim, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1.0 + rand(dim, scale=0.1)
    w["model.norm.weight"] = 1.0 + rand(dim, scale=0.1)
    head = rand(vocab, dim, scale=3.0 * dim**-0.5)
    if cfg.get("model_type") == "qwen3":  # per-head q/k norms, drawn last so a Llama's weights stay as pinned
        for i in range(int(cfg["num_hidden_layers"])):  # type: ignore[call-overload]
            for name in ("q_norm", "k_norm"):
                w[f"model.layers.{i}.self_attn.{name}.weight"] = 1.0 + rand(hd, scale=0.1)
    head[: len(SPECIAL_TOKENS)] = 0.0  # special tokens are never a confident choice, so runs go on
    w["lm_head.weight"] = head
    return {k: v.contiguous() for k, v in w.items()}


def make_tiny_model(out_dir: Path | str, seed: int = 0, max_seq_len: int = 1024) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json to out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    cfg = tiny_config(tok.get_vocab_size(), max_seq_len)
    save_file(make_tiny_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok_cfg = {
        "chat_template": CHATML_TEMPLATE,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    return out


THINK_MARKERS = ["<think>", "</think>"]


def make_tiny_qwen3(out_dir: Path | str, chat_template: str, seed: int = 0, max_seq_len: int = 1024) -> Path:
    """A tiny random Qwen3 folder with Qwen3's vocabulary layout: ChatML specials, `<think>` and `</think>` as added
    tokens that are not special (as Qwen3's are: a template writes them, a user's text may hold them), and the given
    chat template (Qwen3's own, tests/fixtures/templates). The markers' head rows are zero, so the model never writes
    them by itself (their logit is 0): a test forces thinking with a logit bias or a continued `<think>`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer()
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in THINK_MARKERS])
    tok.save(str(out / "tokenizer.json"))
    cfg: dict[str, object] = {**tiny_config(tok.get_vocab_size(with_added_tokens=True), max_seq_len),
                              "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "eos_token_id": 2,
                              "bos_token_id": None}
    weights = make_tiny_weights(cfg, seed)
    for marker in THINK_MARKERS:
        weights["lm_head.weight"][tok.token_to_id(marker)] = 0.0
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok_cfg = {"chat_template": chat_template, "bos_token": None, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}, indent=2))
    return out
