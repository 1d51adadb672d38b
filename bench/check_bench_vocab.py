"""Both servers read a bench file's vocabulary alike: for each GGUF, llama-server's /tokenize of every text the served
bench and the fidelity script send (the short chats, the ~1,000-token prompt, the fidelity prompts) against the
tokenizer webchat's converter builds from the same file's fields (webchat.gguf.vocab.build_tokenizer), and its
/detokenize of a few ids, padded ones included, against that tokenizer's decoding. Prints one line per file; exits 1
on any difference.

    .venv/bin/python -m bench.check_bench_vocab [FILE.gguf ...]     # default: bench/make_bench_files.sh's files
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

from bench.common import find_llama_server, free_port, llama_server
from bench.fidelity_llama_cpp import PROMPTS
from bench.served_files import SETS, bench_files_dir
from bench.served_prompts import TOPICS, long_chat, short_chat


def texts() -> list[str]:
    chats = [short_chat(i) for i in range(len(TOPICS))] + [long_chat()] + PROMPTS
    return [m["content"] for chat in chats for m in chat]


def webchat_tokenizer(gguf: Path) -> object:
    import gguf as gg

    from webchat.gguf.vocab import Fields, build_tokenizer

    reader = gg.GGUFReader(str(gguf))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}
    return build_tokenizer(Fields(fields))


def check(binary: Path, gguf: Path) -> list[str]:
    tok = webchat_tokenizer(gguf)
    vocab = tok.get_vocab_size()  # type: ignore[attr-defined]
    server = llama_server(binary, gguf, free_port(), 2048, 1)
    problems = []
    try:
        server.wait_ready()
        client = httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=120)
        for text in texts():
            body = {"content": text, "add_special": False, "parse_special": False}
            theirs = client.post("/tokenize", json=body).raise_for_status().json()["tokens"]
            ours = tok.encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]
            if theirs != ours:
                problems.append(f"{text[:40]!r}...: llama.cpp {theirs[:12]}... webchat {ours[:12]}...")
        for ids in ([vocab - 1], [vocab // 2, 300, vocab - 2], [17, 42, 4000]):
            theirs = client.post("/detokenize", json={"tokens": ids}).raise_for_status().json()["content"]
            ours = tok.decode(ids, skip_special_tokens=False)  # type: ignore[attr-defined]
            if theirs != ours:
                problems.append(f"detokenize {ids}: llama.cpp {theirs!r} webchat {ours!r}")
    finally:
        server.stop()
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", type=Path, nargs="*")
    ap.add_argument("--llama-server", type=Path, default=None)
    args = ap.parse_args()
    files = args.files or [bench_files_dir() / f for f in SETS["issue38"][0] + ["smollm2-135m-q4_k_m.gguf"]]
    binary = find_llama_server(args.llama_server)
    failed = False
    for gguf in files:
        problems = check(binary, gguf)
        print(f"{gguf.name}: {len(texts())} texts tokenized and 3 id lists detokenized alike" if not problems
              else f"{gguf.name}: {len(problems)} differences", flush=True)
        for p in problems:
            print(f"  {p}")
        failed |= bool(problems)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
