"""Read a Hugging Face-style model folder (config.json + safetensors) into webchat's Transformer, its weights as the
folder holds them; webchat.kernels.backend.load_model then installs the fastest backend this machine runs.

Weights: the folder's quantized.safetensors (ggml blocks, docs/quant.md) on the CPU when present and the C++ kernels
are handed in, else the float tensors; `weights="float32"` forces the float ones, `quantize="q8_0"|"q4_0"` quantizes
float tensors at load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from webchat.gguf.blocks import ALL_QTYPES, dequantize, dequantize_k, quantize
from webchat.gguf.convert import FLOATS_IN_BLOCKS_KEY, QUANT_FILE, QUANT_KEY
from webchat.model.arena import into_huge_pages
from webchat.model.config import ModelArgs
from webchat.model.quant import BlockKernels, QEmbedding, QLinear, swap_modules
from webchat.model.transformer import Transformer
from webchat.model.weights import QUANTIZE, WEIGHTS

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
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",  # Qwen3, Gemma 3
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
}
# Gemma 2/3 name their four norms differently: post_attention_layernorm is the attention output's norm
GEMMA_MAP = {
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.attention_post_norm.weight",
    "model.layers.{}.pre_feedforward_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.post_feedforward_layernorm.weight": "layers.{}.ffn_post_norm.weight",
}
# Phi-3's fused matrices, split by rows at load into the Llama names: qkv_proj → q, k, v; gate_up_proj → gate, up
FUSED = {"self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
         "mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}
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


def read_model(path: Path, device: torch.device, dtype: torch.dtype, weights: str, quantize: str | None,
               kernels: BlockKernels | None) -> Transformer:  # fmt: skip
    """Build the model on the meta device, swap in quantized modules, then assign every tensor, checking names and
    shapes (its rope tables set up; no backend installed). See the module docstring for `weights` and `quantize`;
    quantized weights need `kernels`."""
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    args = ModelArgs.from_dir(path)
    quantized = quantized_weights(path, device, dtype, weights, quantize) and kernels is not None
    if quantized and quantize is None:
        tensors, qtypes = _prepare_quantized(*_read_quantized(path), args)
    elif quantized and quantize is not None:
        tensors, qtypes = _quantize_tensors(_prepare(_read_tensors(path), args), quantize, args)
    else:
        tensors, qtypes = _prepare(_read_tensors(path), args), {}
    with torch.device("meta"):
        model = Transformer(args)
    ours_qtypes = {_map_name(name, args): qt for name, qt in qtypes.items()}
    modules = {name.removesuffix(".weight"): qt for name, qt in ours_qtypes.items() if name is not None}
    if args.tie_embeddings and "tok_embeddings" in modules:
        modules["output"] = modules["tok_embeddings"]
    swap_modules(model, modules, kernels)
    expected = {name: (p.shape, p.dtype) for name, p in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for ckpt_name, tensor in tensors:
        ours = _map_name(ckpt_name, args)
        if ours is None:
            raise ModelLoadError(f"{path}: unexpected tensor {ckpt_name!r} for {args.arch}")
        if ours == "output.weight" and args.tie_embeddings:
            continue
        if ours not in expected:
            raise ModelLoadError(f"{path}: tensor {ckpt_name!r} does not fit the config ({args.n_layers} layers)")
        shape, want_dtype = expected[ours]
        if tuple(tensor.shape) != tuple(shape):
            got = tuple(tensor.shape)
            raise ModelLoadError(f"{path}: tensor {ckpt_name!r} has shape {got}, expected {tuple(shape)}")
        state[ours] = tensor if want_dtype == torch.uint8 else tensor.to(device=device, dtype=dtype)
    if args.tie_embeddings and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{path}: missing tensor(s) {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    model.load_state_dict(state, assign=True, strict=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.eval()
    del state, tensors  # the model holds its tensors now: each old one goes as it is moved
    if device.type == "cpu":
        # one mapping on 2 MiB pages: decode reads every weight a token (webchat.model.arena); an embedding that is
        # not the head is only gathered, and stays where only the rows read are resident
        into_huge_pages(model, leave=[] if args.tie_embeddings else [model.tok_embeddings.weight])
    model.setup_rope(args.max_seq_len)
    return model


def weights_name(model: torch.nn.Module) -> str:
    """What the matrices run as: "q4_1" (the commonest quantized type among them), or the float dtype."""
    kinds = [m.qtype for m in model.modules() if isinstance(m, QLinear | QEmbedding)]
    if kinds:
        return max(sorted(set(kinds)), key=kinds.count)
    return str(model.norm.weight.dtype).removeprefix("torch.")  # type: ignore[union-attr]


def quantized_weights(path: Path, device: torch.device, dtype: torch.dtype, weights: str,
                      quantize: str | None) -> bool:  # fmt: skip
    """Whether the settings ask for quantized weights (given the C++ kernels to run them); ValueError naming a setting
    that cannot be."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    if quantize is not None and weights == "float32":
        raise ValueError("--quantize and --weights float32 contradict each other; pick one")
    cpu_f32 = device.type == "cpu" and dtype == torch.float32
    has_file = (path / QUANT_FILE).is_file()
    asked = quantize is not None or weights == "quantized"
    wanted = asked or (weights == "auto" and has_file)
    if asked and not cpu_f32:
        raise ValueError(f"quantized weights run on the CPU in float32; got device {device} and dtype {dtype}")
    if weights == "quantized" and quantize is None and not has_file:
        raise ValueError(f"{path} has no {QUANT_FILE}; quantize at load with --quantize {'|'.join(QUANTIZE)}")
    return wanted and cpu_f32


def _read_quantized(path: Path) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    with safe_open(str(path / QUANT_FILE), framework="pt") as f:
        meta = f.metadata() or {}
        if QUANT_KEY not in meta:
            raise ModelLoadError(f"{path / QUANT_FILE}: metadata lacks {QUANT_KEY!r} (see docs/quant.md)")
        qtypes: dict[str, str] = json.loads(meta[QUANT_KEY])
        tensors = [(name, f.get_tensor(name)) for name in f.keys() if not IGNORED.match(name)]
    bad = sorted({qt for qt in qtypes.values() if qt not in ALL_QTYPES})
    if bad:
        raise ModelLoadError(f"{path / QUANT_FILE}: quantized type(s) {bad}; webchat runs {', '.join(ALL_QTYPES)}")
    return tensors, qtypes


def _prepare_quantized(tensors: list[tuple[str, torch.Tensor]], qtypes: dict[str, str],
                       args: ModelArgs) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """A blocks file's tensors as _prepare leaves float ones: a fused matrix split by rows (whole rows of blocks, the
    bytes unchanged; each part keeps the matrix's type), Gemma's float norms as 1 + w."""
    parts: dict[str, str] = {}
    for name, qt in qtypes.items():
        m = re.match(r"(model\.layers\.\d+)\.(.*)$", name)
        if m and m.group(2) in FUSED:
            group = m.group(2).split(".")[0]
            parts.update({f"{m.group(1)}.{group}.{part}.weight": qt for part in FUSED[m.group(2)]})
        else:
            parts[name] = qt
    return _prepare(tensors, args), parts


def _quantize_tensors(
    tensors: list[tuple[str, torch.Tensor]], qtype: str, args: ModelArgs
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """Matrices of the layers to qtype, the embedding (and an untied head) to q8_0; K % 32 != 0 stays float."""
    out, qtypes = [], {}
    for name, t in tensors:
        ours = _map_name(name, args) or ""
        kind = qtype if ours.startswith("layers.") else "q8_0"
        if t.dim() == 2 and t.shape[1] % 32 == 0 and ours.endswith("weight") and "norm" not in ours:
            t, qtypes[name] = quantize(t, kind), kind
        out.append((name, t))
    return out, qtypes


def _map_name(name: str, args: ModelArgs) -> str | None:
    if IGNORED.match(name):
        return None
    table = {**WEIGHT_MAP, **GEMMA_MAP} if args.sandwich_norm else WEIGHT_MAP
    m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
    if m:
        key = f"model.layers.{{}}.{m.group(2)}"
        ours = table.get(key)
        return ours.format(m.group(1)) if ours else None
    return table.get(name)


def _prepare(tensors: list[tuple[str, torch.Tensor]], args: ModelArgs) -> list[tuple[str, torch.Tensor]]:
    """Float checkpoint tensors as the model holds them: fused matrices split, Gemma's norms as 1 + w (float32)."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors:
        m = re.match(r"(model\.layers\.\d+)\.(.*)$", name)
        if m and m.group(2) in FUSED:
            out.extend(_split_fused(m.group(1), m.group(2), t, args))
        elif args.norm_plus_one and name.endswith("norm.weight"):
            out.append((name, t.float() + 1.0))
        else:
            out.append((name, t))
    return out


def _split_fused(layer: str, leaf: str, t: torch.Tensor, args: ModelArgs) -> list[tuple[str, torch.Tensor]]:
    """Phi-3's qkv_proj (q; k; v rows) and gate_up_proj (gate; up rows) as separate Llama-named matrices."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    rows = [q, kv, kv] if leaf.startswith("self_attn.") else [args.ffn_dim, args.ffn_dim]
    if t.shape[0] != sum(rows):
        want = " + ".join(map(str, rows))
        raise ModelLoadError(f"tensor {layer}.{leaf!r} has {t.shape[0]} rows, expected {sum(rows)} ({want})")
    group = leaf.split(".")[0]
    return [(f"{layer}.{group}.{part}.weight", w.contiguous())
            for part, w in zip(FUSED[leaf], torch.split(t, rows, dim=0), strict=True)]


def _read_tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors (or model.safetensors.index.json) in {path}")
    out: list[tuple[str, torch.Tensor]] = []
    in_blocks = False
    for fname in files:
        with safe_open(str(path / fname), framework="pt") as f:
            in_blocks |= FLOATS_IN_BLOCKS_KEY in (f.metadata() or {})
            out.extend((name, f.get_tensor(name)) for name in f.keys() if not IGNORED.match(name))
    if in_blocks:  # a big GGUF's folder: its block matrices are in QUANT_FILE only, decoded here as the converter would
        have = {name for name, _ in out}
        blocks, qtypes = _read_quantized(path)
        out.extend((name, _decode(t, qtypes[name])) for name, t in blocks if name in qtypes and name not in have)
    return out


def _decode(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 of a matrix's ggml blocks, the values webchat.gguf.convert writes for it."""
    return dequantize_k(blocks, qtype) if qtype in ("q4_k", "q5_k", "q6_k") else dequantize(blocks, qtype)
