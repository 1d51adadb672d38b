"""Gemma 2, Gemma 3 and Phi-3 GGUFs read by webchat and by llama.cpp itself: the same tokens, the same greedy text, the
same probabilities. llama.cpp runs float32 all through (`-ctk f32 -ctv f32 -fa off`), as webchat does.

    bash bench/build_llama_server.sh      # once
    .venv/bin/python bench/compare_llama_cpp_archs.py

tests/test_gguf_spm.py checks webchat against transformers and SentencePiece on GGUFs written the way
convert_hf_to_gguf.py writes them (tests/gguf_write.py). This script asks the engine that defines the format: for each
architecture it writes the same tiny random model with a SentencePiece vocabulary (F32, so that no quantization
differs), starts llama-server on it alone and compares, per text, /tokenize (no BOS, special tokens read as text)
with webchat's encode_text, then a greedy /completion of 16 tokens on webchat's prompt ids with webchat's greedy
tokens, and, where those agree, each step's top-5 probabilities (the largest difference printed).
"""

from __future__ import annotations

import argparse
import io
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from bench_served import find_llama_server, free_port  # bench/ is the script's directory

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gguf_write import train_spm, write_gguf  # noqa: E402
from tests.test_gguf_spm import CONFIGS, CONTROL, GEMMA_TEMPLATE, PHI3_TEMPLATE, PREFIX, TEXTS, USER_DEFINED, spm_folder  # noqa: E402  # noqa: E402
from webchat.gguf_path import model_folder  # noqa: E402
from webchat.model.loader import load_model  # noqa: E402
from webchat.text.tokenizer import Tokenizer  # noqa: E402

PROMPT = "The quick brown fox"
DECODE = 16


def serve(binary: Path, gguf: Path) -> tuple[subprocess.Popen[bytes], httpx.Client]:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "-c", "256", "-t", "2", "-np", "1", "--swa-full",
           "-ctk", "f32", "-ctv", "f32", "-fa", "off"]  # float32 all through, as webchat computes
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    for _ in range(300):
        try:
            if client.get("/health").status_code == 200:
                return proc, client
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"llama-server did not come up on {gguf}")


def ours_greedy(folder: Path, ids: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    model = load_model(folder, weights="float32")
    ids = list(ids)
    cache = model.new_cache(len(ids) + DECODE)
    logits = cache.feed(model, ids)[-1]
    out, tops = [], []
    for _ in range(DECODE):
        p = torch.softmax(logits.double(), -1)
        top = torch.topk(p, 5)
        tops.append({int(i): float(v) for v, i in zip(top.values, top.indices, strict=True)})
        out.append(int(logits.argmax()))
        logits = cache.feed(model, out[-1:])[-1]
    return out, tops


def compare(arch: str, binary: Path, work: Path, **overrides: Any) -> dict[str, Any]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    corpus = "\n".join(p.read_text(encoding="utf-8") for p in docs)
    vocab = train_spm(work / "spm", corpus, 800, PREFIX[arch], CONTROL, USER_DEFINED)
    spm_folder(arch, work / "hf", vocab, **overrides)
    gguf = work / f"tiny-{arch}.gguf"
    write_gguf(work / "hf", gguf, arch, spm=vocab, template=PHI3_TEMPLATE if arch == "phi3" else GEMMA_TEMPLATE)
    folder = model_folder(gguf, out=io.StringIO())
    tok = Tokenizer.from_dir(folder)
    prompt = tok.encode_text(PROMPT)
    ours, our_tops = ours_greedy(folder, prompt)
    proc, client = serve(binary, gguf)
    try:
        same_tokens = 0
        for text in TEXTS:
            theirs = client.post("/tokenize", json={"content": text, "add_special": False,
                                                    "parse_special": False}).json()["tokens"]
            mine = tok.encode_text(text)[1:]
            same_tokens += theirs == mine
            if theirs != mine:
                print(f"  {arch}: {text!r}: llama.cpp {theirs} webchat {mine}")
        body = {"prompt": prompt, "n_predict": DECODE, "temperature": 0, "n_probs": 5, "return_tokens": True}
        answer = client.post("/completion", json=body).json()
    finally:
        proc.kill()
        proc.wait()
    theirs_ids = answer["tokens"]
    diff, step, seen = 0.0, 0, 0
    for entry in answer["completion_probabilities"]:  # a character split over byte tokens comes as one entry
        while step < len(ours) and ours[step] != entry["id"]:
            step, seen = step + 1, seen + 1
        if step == len(ours):
            break
        for alt in entry["top_logprobs"]:
            if alt["id"] in our_tops[step]:
                diff = max(diff, abs(math.exp(alt["logprob"]) - our_tops[step][alt["id"]]))
        step, seen = step + 1, seen + 1
    name = arch + "".join(f", {k}={v}" for k, v in overrides.items())
    return {"arch": name, "texts": f"{same_tokens}/{len(TEXTS)}", "greedy": theirs_ids == ours,
            "p_diff": diff if seen and theirs_ids == ours else None, "ours": ours, "theirs": theirs_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--arch", choices=list(CONFIGS), action="append")
    args = ap.parse_args()
    binary = find_llama_server(args.llama_server)
    print("| architecture | texts tokenized alike | 16 greedy tokens alike | largest top-5 p difference |")
    print("|---|---:|---|---:|")
    runs: list[tuple[str, dict[str, Any]]] = [(arch, {}) for arch in args.arch or list(CONFIGS)]
    if "phi3" in (args.arch or list(CONFIGS)):  # llama.cpp turns Phi-3's window off (llama.cpp#13676); webchat keeps it
        runs.append(("phi3", {"sliding_window": None}))
    for arch, overrides in runs:
        with tempfile.TemporaryDirectory() as tmp:
            r = compare(arch, binary, Path(tmp), **overrides)
        p = "n/a" if r["p_diff"] is None else f"{r['p_diff']:.2e}"
        print(f"| {r['arch']} | {r['texts']} | {'yes' if r['greedy'] else 'NO'} | {p} |", flush=True)
        if not r["greedy"]:
            print(f"  webchat {r['ours']}\n  llama.cpp {r['theirs']}")


if __name__ == "__main__":
    main()
