"""A reply about an image, webchat against transformers on a vision fixture (issue 61's acceptance): the same prompt
token count (and ids), the first token's top 5 and their probabilities, and greedy tokens with no stop token.

webchat runs the request path a server runs (LocalPreparer: the image decoded, planned, the template rendered and
expanded) and the engine (the image encoded when its prefill starts, its rows in place of the slot tokens); the
reference is transformers' processor and model in float32. `exact` is the float32 text model with the exact encoder;
`int8` the text model quantized to Q8_0 at load with int8 activations and the int8 encoder.

Usage: python -m bench.vision_fidelity [smolvlm gemma3 ...] [--tokens 16]   (prints one table)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image as PILImage

from bench import vision_fixtures
from bench.common import table_header, table_row

PROMPT = "What is in this picture?"
WIDTH, HEIGHT = 2048, 512  # SmolVLM: 4 x 1 tiles + the overview, 5 tiles, 320 image tokens; Gemma 3: 256


@dataclass
class Reference:
    input_ids: list[int]
    first: torch.Tensor  # (vocab,) float64 probabilities of the first new token
    greedy: list[int]  # greedy tokens, no stop token ending them


@dataclass
class Served:
    prompt_ids: list[int]
    image_tokens: int
    top: list[tuple[int, float]]  # the first token's alternatives (id, p), most likely first
    greedy: list[int]
    encode_ms: float


@dataclass
class Figures:
    same_ids: bool
    prompt_tokens: tuple[int, int]  # (webchat, transformers)
    top5_same: bool
    max_dp: float  # max |p - p_ref| over webchat's top 5
    greedy_same: int  # leading greedy tokens that agree


def picture(width: int = WIDTH, height: int = HEIGHT, seed: int = 1) -> PILImage.Image:
    """Gradients, stripes and noise (tests/vision/pictures.py's): every resize filter's weights show."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    r, g = (255 * x / max(width - 1, 1)).astype(np.int64), (255 * y / max(height - 1, 1)).astype(np.int64)
    b = ((x // 7 + y // 5) % 2) * 200
    noise = rng.integers(0, 40, size=(height, width, 3))
    return PILImage.fromarray(np.clip(np.stack([r, g, b], axis=-1) + noise, 0, 255).astype(np.uint8))


def data_url(pil: PILImage.Image) -> str:
    buf = io.BytesIO()
    pil.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def reference(hf_dir: Path, pil: PILImage.Image, text: str, n_new: int) -> Reference:
    """transformers' processor and model (float32, eager attention): one user message, the image then the text."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(hf_dir)
    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    messages = [{"role": "user", "content": [{"type": "image", "image": pil}, {"type": "text", "text": text}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        out = model.eval()(**inputs, use_cache=True)
        first = torch.softmax(out.logits[0, -1].double(), -1)
        greedy = [int(first.argmax())]
        cache = out.past_key_values
        for _ in range(n_new - 1):  # no stop token: each step's argmax, as the engine's with stop_token_ids=[]
            step = model(input_ids=torch.tensor([[greedy[-1]]]), cache=cache, use_cache=True,
                         attention_mask=torch.ones(1, len(ids) + len(greedy), dtype=torch.long))
            cache = step.past_key_values
            greedy.append(int(step.logits[0, -1].argmax()))
    return Reference(ids, first, greedy)


def runtime(fx: vision_fixtures.Fixture, precision: str = "exact") -> Any:
    """The fixture served as `webchat serve --model <text>.gguf --mmproj <mmproj>.gguf` loads it (int8: the text
    model quantized to Q8_0 at load, int8 activations, the int8 encoder)."""
    from webchat.files.gguf_cache import model_folder
    from webchat.serve.config import ServerConfig
    from webchat.serve.runtime import load_runtime

    int8 = precision == "int8"
    return load_runtime(ServerConfig(model_dir=model_folder(fx.text_gguf), mmproj=fx.mmproj_f16, speculative="none",
                                     quantize="q8_0" if int8 else None, exact=not int8, mmproj_precision=precision))


def served(rt: Any, pil: PILImage.Image, text: str, n_new: int) -> Served:
    """The chat through the runtime's request path and engine: greedy, no stop token, the first token's top 5."""
    from webchat.engine.settings import SamplingSettings
    from webchat.serve.requests import Turn

    messages = [{"role": "user", "content": [{"type": "image", "url": data_url(pil)}, {"type": "text", "text": text}]}]
    turn = Turn(messages=messages, settings=lambda _: SamplingSettings(temperature=0.0), max_new_tokens=n_new,
                fit=False, top_alts=5, want_probs=True)
    request = asyncio.run(rt.prep.chat(turn)).request
    request.stop_token_ids = []
    gen = rt.new_generator()
    gen.begin_stream(request)
    tokens = []
    while True:
        result = gen.stream()
        tokens += result.tokens
        if result.eos:
            break
    assert result.stats is not None
    first = tokens[0]
    return Served(list(request.prompt_ids), result.stats.image_tokens, [(t, p) for t, _, p in first.top],
                  [t.id for t in tokens], result.stats.encode_ms)


def compare(ours: Served, ref: Reference) -> Figures:
    top_ref = set(ref.first.topk(5).indices.tolist())
    greedy = next((i for i, (a, b) in enumerate(zip(ours.greedy, ref.greedy, strict=False)) if a != b),
                  min(len(ours.greedy), len(ref.greedy)))
    return Figures(ours.prompt_ids == ref.input_ids, (len(ours.prompt_ids), len(ref.input_ids)),
                   {t for t, _ in ours.top[:5]} == top_ref,
                   max(abs(p - float(ref.first[t])) for t, p in ours.top[:5]), greedy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fixtures", nargs="*", default=["smolvlm", "gemma3"], choices=list(vision_fixtures.SPECS))
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(2)
    pil = picture()
    rows = []
    for name in args.fixtures:
        fx = vision_fixtures.build(name)
        ref = reference(fx.hf_dir, pil, PROMPT, args.tokens)
        for precision in ("exact", "int8"):
            rt = runtime(fx, precision)
            t0 = time.perf_counter()
            ours = served(rt, pil, PROMPT, args.tokens)
            wall = time.perf_counter() - t0
            f = compare(ours, ref)
            rows.append([name, precision, f"{f.prompt_tokens[0]} / {f.prompt_tokens[1]}", str(f.same_ids),
                         str(ours.image_tokens), str(f.top5_same), f"{f.max_dp:.2e}", f"{f.greedy_same}/{args.tokens}",
                         f"{ours.encode_ms / 1000:.2f}", f"{wall:.2f}"])
            del rt
    print(f"A {WIDTH}x{HEIGHT} image, '{PROMPT}', greedy {args.tokens} tokens with no stop; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(table_header("fixture", "path", "prompt tokens (webchat / transformers)", "same ids", "image tokens",
                       "top-5 set", "max abs dp, top 5", "greedy equal", "encode s", "request s", align="llrrrrrrrr"))
    for row in rows:
        print(table_row(*row))


if __name__ == "__main__":
    main()
