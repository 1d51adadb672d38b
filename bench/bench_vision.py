"""The vision encoder's time on one image (default 2048x512: SmolVLM's 4 tiles + the global image) against llama.cpp's
encoder on the same mmproj file, in one run, rounds alternating: webchat exact (float32, torch's sgemm), webchat int8
(Q8_0 blocks, 8-bit activations), the PyTorch encoder, and llama-mtmd-cli (the sum of its "mtmd batch encoding done
in N ms" lines: each tile's encoder, nothing of the text model). Prints each round, the medians, the ratios, and the
int8 path's error against the exact one. The fixture is built first if missing (bench.vision_fixtures).

Usage: python -m bench.bench_vision [--fixture smolvlm|gemma3] [--image 2048x512] [--rounds 3] [--llama PATH]
       [--threads 2]
"""

from __future__ import annotations

import argparse
import io
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image as PILImage

from bench import vision_fixtures
from webchat.files.home import webchat_home
from webchat.vision.image import decode_image
from webchat.vision.projector import Projector, load_projector

ENCODED = re.compile(r"(?:batch encoding done|slice encoded) in (\d+) ms")


def picture(width: int, height: int) -> bytes:
    """A PNG of gradients and stripes (the encoder's time does not depend on the content)."""
    y = torch.arange(height).view(-1, 1).expand(height, width)
    x = torch.arange(width).view(1, -1).expand(height, width)
    rgb = torch.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), ((x // 7 + y // 5) % 2) * 200], -1)
    buf = io.BytesIO()
    PILImage.fromarray(rgb.to(torch.uint8).numpy()).save(buf, "PNG")
    return buf.getvalue()


def default_llama() -> Path | None:
    found = sorted((webchat_home() / "llama-server").glob("llama_cpp_python-*/build/bin/llama-mtmd-cli"))
    return found[-1] if found else None


def llama_encode_s(binary: Path, fx: vision_fixtures.Fixture, image: Path, threads: int) -> float:
    """llama.cpp's encoder seconds for the image (every tile), from llama-mtmd-cli's log."""
    argv = [str(binary), "-m", str(fx.text_gguf), "--mmproj", str(fx.mmproj_f16), "--image", str(image), "-p",
            "Describe the image.", "-n", "1", "-t", str(threads), "--temp", "0", "--no-warmup"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    times = [int(m) for m in ENCODED.findall(proc.stdout + proc.stderr)]
    if proc.returncode != 0 or not times:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"llama-mtmd-cli failed (exit {proc.returncode}) or printed no encoder time:\n{tail}")
    return sum(times) / 1000


def ours_s(proj: Projector, tiles: torch.Tensor, reference: bool = False) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    rows = proj.encode_reference(tiles) if reference else proj.encode_tiles(tiles)
    return time.perf_counter() - t0, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixture", default="smolvlm", choices=sorted(vision_fixtures.SPECS))
    ap.add_argument("--image", default="2048x512", help="WIDTHxHEIGHT of the test picture")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama", type=Path, default=default_llama(), help="llama-mtmd-cli (bench/build_llama_server.sh "
                                                                        "builds the tree; cmake --build build --target "
                                                                        "llama-mtmd-cli)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-reference", action="store_true", help="skip the PyTorch encoder's rounds")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fx = vision_fixtures.build(args.fixture)
    width, height = (int(v) for v in args.image.lower().split("x"))
    data = picture(width, height)
    t0 = time.perf_counter()
    exact = load_projector(fx.mmproj_f16, precision="exact")
    t1 = time.perf_counter()
    int8 = load_projector(fx.mmproj_f16, precision="int8")
    print(f"load: exact {t1 - t0:.2f} s, int8 {time.perf_counter() - t1:.2f} s", flush=True)
    t0 = time.perf_counter()
    plan = exact.plan(decode_image(data))
    prepare = time.perf_counter() - t0
    n = plan.tiles.shape[0]
    print(f"{fx.name}: {fx.mmproj_f16.name}, a {width}x{height} image: {n} tiles of {exact.image_size}, "
          f"{plan.n_tokens} image tokens; {args.threads} threads; backend {exact.backend}; decode + plan "
          f"{prepare:.2f} s", flush=True)
    runs: dict[str, list[float]] = {"exact": [], "int8": [], "pytorch": [], "llama.cpp": []}
    rows: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "image.png"
        image.write_bytes(data)
        steps: list[tuple[str, Callable[[], float]]] = []
        for name, proj in (("exact", exact), ("int8", int8)):
            steps.append((name, lambda p=proj, k=name: _record(rows, k, *ours_s(p, plan.tiles))))
        if not args.no_reference:
            steps.append(("pytorch", lambda: _record(rows, "pytorch", *ours_s(exact, plan.tiles, reference=True))))
        if args.llama is not None and args.llama.is_file():
            steps.append(("llama.cpp", lambda: llama_encode_s(args.llama, fx, image, args.threads)))
        else:
            print("llama.cpp: no llama-mtmd-cli (pass --llama); its rounds are skipped", flush=True)
        for r in range(args.rounds):
            for name, step in steps:
                s = step()
                runs[name].append(s)
                print(f"round {r + 1}: {name:10s} {s:7.2f} s", flush=True)
    print("\nmedian seconds for the image's encoder (all tiles):")
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    for name, s in med.items():
        ratio = f"   {s / med['llama.cpp']:.2f}x llama.cpp's" if "llama.cpp" in med and name != "llama.cpp" else ""
        print(f"  {name:10s} {s:7.2f} s  ({s / n:.2f} s a tile){ratio}")
    ref = rows["exact"]
    err = float((rows["int8"] - ref).abs().max() / ref.abs().max())
    print(f"int8 against exact: max |d| / max |exact| = {err:.2e}")
    if "pytorch" in rows:
        print(f"exact against the PyTorch encoder: {float((ref - rows['pytorch']).abs().max() / ref.abs().max()):.2e}")


def _record(rows: dict[str, torch.Tensor], name: str, seconds: float, out: torch.Tensor) -> float:
    rows[name] = out
    return seconds


if __name__ == "__main__":
    main()
