"""Load a Hugging Face-style model folder (config.json + safetensors) into webchat's Transformer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from webchat.config import ModelArgs
from webchat.model import Transformer

# checkpoint name → ours (gpt-fast's weight_map); {} is the layer index
WEIGHT_MAP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
CPU_DTYPES = (torch.float32, torch.bfloat16)
CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model folder that does not match its config: a missing, unexpected or mis-shaped tensor."""


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device (torch {torch.__version__})")
    return torch.device(name)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    dtype = DTYPES[name]
    allowed = CUDA_DTYPES if device.type == "cuda" else CPU_DTYPES
    if dtype not in allowed:
        raise ValueError(f"dtype {name} is not supported on {device.type}; use one of {[str(d) for d in allowed]}")
    return dtype


def load_model(
    path: Path | str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """Build the model on the meta device, then assign every checkpoint tensor, checking names and shapes."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    device = torch.device(device)
    args = ModelArgs.from_dir(path)
    with torch.device("meta"):
        model = Transformer(args)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for ckpt_name, tensor in _read_tensors(path):
        ours = _map_name(ckpt_name)
        if ours is None:
            raise ModelLoadError(f"{path}: unexpected tensor {ckpt_name!r} for {args.arch}")
        if ours == "output.weight" and args.tie_embeddings:
            continue
        if ours not in expected:
            raise ModelLoadError(f"{path}: tensor {ckpt_name!r} does not fit the config ({args.n_layers} layers)")
        if tuple(tensor.shape) != tuple(expected[ours]):
            raise ModelLoadError(
                f"{path}: tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected[ours])}"
            )
        state[ours] = tensor.to(device=device, dtype=dtype)
    if args.tie_embeddings and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{path}: missing tensor(s) {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    model.load_state_dict(state, assign=True, strict=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.eval()
    model.setup_rope(args.max_seq_len)
    if device.type == "cuda":  # CudaOps kernels and CUDA graphs where CuPy is installed (webchat.cuda_backend)
        from webchat.cuda_backend import enable_cuda_backend

        enable_cuda_backend(model)
    return model


def _map_name(name: str) -> str | None:
    if IGNORED.match(name):
        return None
    m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
    if m:
        key = f"model.layers.{{}}.{m.group(2)}"
        ours = WEIGHT_MAP.get(key)
        return ours.format(m.group(1)) if ours else None
    return WEIGHT_MAP.get(name)


def _read_tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors (or model.safetensors.index.json) in {path}")
    out: list[tuple[str, torch.Tensor]] = []
    for fname in files:
        with safe_open(str(path / fname), framework="pt") as f:
            out.extend((name, f.get_tensor(name)) for name in f.keys() if not IGNORED.match(name))
    return out
