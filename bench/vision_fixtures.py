"""Seeded random-weight vision checkpoints (SmolVLM-256M-shaped, Gemma-3-shaped) and the GGUFs llama.cpp's own
converter writes from them: the text model and its projector (`--mmproj`), into $WEBCHAT_HOME/bench-files/vision/.

Each fixture is a Hugging Face folder that transformers loads as the reference (model, tokenizer, image processor,
processor, chat template; no hub) and three GGUFs: `<name>.gguf` (the text model, F16), `mmproj-<name>-f16.gguf`
and `mmproj-<name>-q8_0.gguf`. Every weight is rounded to float16 before the folder is written, so the F16 GGUFs hold
exactly the reference's weights. Norm weights, biases and zero-initialised matrices are drawn at random too
(transformers initialises them to 1 and 0, which would hide a missing bias or a `1 + w` norm).

| name | shape | vision | text |
|---|---|---|---|
| smolvlm | SmolVLM-256M-Instruct (idefics3) | SigLIP 768 wide, 12 layers, 512 tiles, 16x16 | SmolLM2-135M, 30 layers |
| smolvlm-mini | the same widths (tests) | 2 layers | 2 layers |
| gemma3 | Gemma 3 (gemma3 projector) | SigLIP-so400m at 896: 1152 wide, 27 layers, 14x14 | 640 wide, 4 layers |
| gemma3-mini | the same widths (tests) | 1 layer | 2 layers |

The reduced-depth fixtures keep every width, patch grid and token count of their class; only the layer counts
change. Tokenizers: SmolVLM's is the default model's SmolLM2 tokenizer.json plus SmolVLM's added tokens (`<global-img>`,
`<row_r_col_c>`, `<fake_token_around_image>`, `<image>`, `<end_of_utterance>`) and its chat template; Gemma 3's is a
SentencePiece BPE model trained here on a seeded word corpus with Gemma 3's special tokens, so the converter takes
its sentencepiece path. Deterministic (seeded) and idempotent: a fixture is built in a `.part` folder and renamed.
Usage: python -m bench.vision_fixtures [NAME ...]   (prints each fixture's paths)
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from webchat.files.home import default_model_dir, webchat_home

VERSION = 3  # bump when what a fixture holds changes: an older folder is rebuilt
TILE_ROWS = 6  # SmolVLM's tokenizer has <row_r_col_c> for r, c in 1..6


@dataclass(frozen=True)
class Spec:
    """One fixture: its family, depths and seed."""

    name: str
    family: str  # "idefics3" | "gemma3"
    vision_layers: int
    text_layers: int
    seed: int


SPECS = {s.name: s for s in (
    Spec("smolvlm", "idefics3", 12, 30, 61),
    Spec("smolvlm-mini", "idefics3", 2, 2, 62),
    Spec("gemma3", "gemma3", 27, 4, 63),
    Spec("gemma3-mini", "gemma3", 1, 2, 64),
)}


@dataclass(frozen=True)
class Fixture:
    """A built fixture's paths."""

    name: str
    family: str
    hf_dir: Path
    text_gguf: Path
    mmproj_f16: Path
    mmproj_q8_0: Path


def fixtures_dir(home: Path | None = None) -> Path:
    return (home if home is not None else webchat_home()) / "bench-files" / "vision"


def fixture_paths(spec: Spec, home: Path | None = None) -> Fixture:
    root = fixtures_dir(home) / spec.name
    return Fixture(spec.name, spec.family, root / "hf", root / f"{spec.name}.gguf",
                   root / f"mmproj-{spec.name}-f16.gguf", root / f"mmproj-{spec.name}-q8_0.gguf")


def build(name: str, home: Path | None = None) -> Fixture:
    """The fixture `name`, built once (a complete folder from an earlier run is returned as it is)."""
    if name not in SPECS:
        raise ValueError(f"unknown fixture {name!r}; expected one of {', '.join(SPECS)}")
    spec = SPECS[name]
    done = fixture_paths(spec, home)
    stamp = done.hf_dir.parent / "fixture.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("version") == VERSION:
        return done
    part = done.hf_dir.parent.with_name(f"{spec.name}.part{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    staged = fixture_paths(spec, home)
    staged = Fixture(spec.name, spec.family, part / "hf", part / staged.text_gguf.name, part / staged.mmproj_f16.name,
                     part / staged.mmproj_q8_0.name)
    staged.hf_dir.mkdir(parents=True)
    (write_idefics3 if spec.family == "idefics3" else write_gemma3)(spec, staged.hf_dir)
    convert = llama_cpp_source() / "convert_hf_to_gguf.py"
    run_converter(convert, staged.hf_dir, staged.text_gguf, "f16", mmproj=False)
    run_converter(convert, staged.hf_dir, staged.mmproj_f16, "f16", mmproj=True)
    run_converter(convert, staged.hf_dir, staged.mmproj_q8_0, "q8_0", mmproj=True)
    (part / "fixture.json").write_text(json.dumps({"version": VERSION, "spec": spec.__dict__}, indent=1) + "\n")
    shutil.rmtree(done.hf_dir.parent, ignore_errors=True)
    part.rename(done.hf_dir.parent)
    return done


def run_converter(script: Path, hf_dir: Path, out: Path, outtype: str, mmproj: bool) -> None:
    """llama.cpp's convert_hf_to_gguf.py on the folder (its own gguf-py, as llama.cpp's users run it)."""
    argv = [sys.executable, str(script), str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    argv += ["--mmproj"] if mmproj else []
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"convert_hf_to_gguf.py {'--mmproj ' if mmproj else ''}--outtype {outtype} on {hf_dir} "
                           f"failed (exit {proc.returncode}):\n{tail}")


def llama_cpp_source(home: Path | None = None) -> Path:
    """The llama.cpp tree vendored in the llama-cpp-python sdist bench/build_llama_server.sh uses (downloaded from PyPI
    and unpacked here when missing; nothing is built)."""
    root = (home if home is not None else webchat_home()) / "llama-server"
    found = sorted(glob.glob(str(root / "llama_cpp_python-*" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py")))
    if found:
        return Path(found[-1]).parent
    root.mkdir(parents=True, exist_ok=True)
    sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-binary",
                        "llama-cpp-python", "--no-deps", "llama-cpp-python>=0.3", "-d", str(root)], check=True)
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdists[-1]) as tar:
        tar.extractall(root, filter="data")
    return llama_cpp_source(home)


def randomize(model: Any, seed: int) -> None:
    """Norm weights, biases and any parameter initialised to zeros (Gemma 3's projection) drawn at random, then every
    parameter rounded to float16 (kept as float32)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                base = 0.0 if _zero_centred(name) else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias") or not p.any():
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            p.copy_(p.half().float())


def _zero_centred(name: str) -> bool:
    """Gemma's RMSNorm scales by (1 + w): its weights sit around 0."""
    return "soft_emb_norm" in name or ("language_model" in name and "norm" in name)


def save_model(model: Any, hf_dir: Path, prefix: tuple[str, str] | None = None) -> None:
    """The model's safetensors; `prefix` (old, new) renames tensors to the layout the released checkpoints use."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(hf_dir, safe_serialization=True)
    if prefix is not None:
        path = hf_dir / "model.safetensors"
        tensors = load_file(path)
        renamed = {prefix[1] + k[len(prefix[0]):] if k.startswith(prefix[0]) else k: v for k, v in tensors.items()}
        save_file(renamed, path, metadata={"format": "pt"})


# --- SmolVLM (idefics3) -----------------------------------------------------------------------------------------

SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def smolvlm_added_tokens() -> list[str]:
    """SmolVLM's added tokens in its order: the global tag, the 36 tile tags, the image tokens, the turn end."""
    rows = [f"<row_{r}_col_{c}>" for r in range(1, TILE_ROWS + 1) for c in range(1, TILE_ROWS + 1)]
    return ["<global-img>", *rows, "<fake_token_around_image>", "<image>", "<end_of_utterance>"]


def write_idefics3(spec: Spec, hf_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration

    src = default_model_dir()
    if not (src / "tokenizer.json").is_file():
        from webchat.files.pull import ensure_default_model

        src = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_special_tokens({"additional_special_tokens": smolvlm_added_tokens()})
    tok.chat_template = SMOLVLM_TEMPLATE
    tok.save_pretrained(hf_dir)
    vocab = 49280  # SmolVLM-256M's: 49152 + its added tokens, padded
    image_token_id = tok.convert_tokens_to_ids("<image>")
    config = Idefics3Config(
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=spec.vision_layers,
                           num_attention_heads=12, patch_size=16, image_size=512, layer_norm_eps=1e-6,
                           hidden_act="gelu_pytorch_tanh", max_image_size={"longest_edge": 512},
                           size={"longest_edge": 2048}),
        text_config=dict(model_type="llama", architectures=["VLlama3ForCausalLM"], hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=spec.text_layers,
                         num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192, vocab_size=vocab, tie_word_embeddings=True,
                         hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=2),
        scale_factor=4, image_token_id=image_token_id, tie_word_embeddings=True, vocab_size=vocab,
    )
    torch.manual_seed(spec.seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    randomize(model, spec.seed)
    save_model(model, hf_dir)
    write_json(hf_dir / "preprocessor_config.json", {
        "image_processor_type": "Idefics3ImageProcessor", "processor_class": "Idefics3Processor",
        "do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True, "do_rescale": True,
        "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "max_image_size": {"longest_edge": 512}, "resample": 1, "rescale_factor": 1 / 255,
        "size": {"longest_edge": 2048}})
    write_json(hf_dir / "processor_config.json", {"image_seq_len": 64, "processor_class": "Idefics3Processor"})


# --- Gemma 3 ------------------------------------------------------------------------------------------------------

GEMMA3_SPECIAL = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
WORDS = (
    "the a of to and in is it you that he was for on are with as I his they be at one have this from or had by hot "
    "word but what some we can out other were all there when up use your how said an each she which do their time "
    "if will way about many then them write would like so these her long make thing see him two has look more day "
    "could go come did number sound no most people my over know water than call first who may down side been now "
    "find image picture red green blue cat dog house tree left right top bottom small large colour photo describe"
).split()


def gemma3_corpus(seed: int) -> list[str]:
    """A seeded corpus of sentences, digits, punctuation and a few non-ASCII words (byte fallback covers the rest)."""
    rng = random.Random(seed)
    words = WORDS + ["café", "naïve", "über", "日本", "ß"]
    lines = []
    for _ in range(4000):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 24)))
        if rng.random() < 0.3:
            line += f" {rng.randint(0, 99999)}"
        lines.append(line.capitalize() + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def write_gemma3_tokenizer(hf_dir: Path, seed: int) -> Any:
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(gemma3_corpus(seed)), model_writer=model, vocab_size=1024, model_type="bpe",
        byte_fallback=True, split_digits=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
        eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=[*GEMMA3_SPECIAL, *NEWLINES], allow_whitespace_only_pieces=True,
        num_threads=1, minloglevel=2, character_coverage=1.0, seed_sentencepiece_size=100000)
    (hf_dir / "tokenizer.model").write_bytes(model.getvalue())
    write_json(hf_dir / "tokenizer_config.json", {
        "tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"},
        "chat_template": GEMMA3_TEMPLATE, "model_max_length": 8192})
    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)  # tokenizer.json beside tokenizer.model
    # as Gemma 3's release writes it: the added tokens by id, the markers special, so llama.cpp's converter types them
    # CONTROL (and the newline runs USER_DEFINED) instead of the NORMAL pieces a SentencePiece model's own are
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(tok.convert_tokens_to_ids(t)): {
        "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": t not in NEWLINES} for t in ["<pad>", "<eos>", "<bos>", "<unk>", *GEMMA3_SPECIAL, *NEWLINES]}
    write_json(hf_dir / "tokenizer_config.json", config)
    return tok


def write_gemma3(spec: Spec, hf_dir: Path) -> None:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = write_gemma3_tokenizer(hf_dir, spec.seed)
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA3_SPECIAL}
    vocab = len(tok)
    config = Gemma3Config(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                           num_hidden_layers=spec.vision_layers, num_attention_heads=16, patch_size=14,
                           image_size=896, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", vision_use_head=False),
        text_config=dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=spec.text_layers,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                         rms_norm_eps=1e-6, vocab_size=vocab, sliding_window=512, max_position_embeddings=32768,
                         hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1, pad_token_id=0),
        mm_tokens_per_image=256, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"], bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    torch.manual_seed(spec.seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    randomize(model, spec.seed)
    # transformers 5 saves SigLIP without its `vision_model.` level; Gemma 3's release (and the converter) have it
    save_model(model, hf_dir, ("vision_tower.", "vision_tower.vision_model."))
    write_json(hf_dir / "preprocessor_config.json", {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "image_seq_length": 256, "resample": 2,
        "rescale_factor": 1 / 255, "size": {"height": 896, "width": 896}})
    write_json(hf_dir / "processor_config.json", {"image_seq_length": 256, "processor_class": "Gemma3Processor"})


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def main() -> None:
    names = sys.argv[1:] or list(SPECS)
    for name in names:
        fx = build(name)
        print(f"{fx.name}: {fx.hf_dir}\n  text  {fx.text_gguf}\n  mmproj {fx.mmproj_f16}\n  mmproj {fx.mmproj_q8_0}",
              flush=True)


if __name__ == "__main__":
    main()
