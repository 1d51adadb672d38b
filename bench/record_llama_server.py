"""Record llama-server's real answers for tests/serve/test_remote_parse.py (tests/fixtures/llama_server.json).

    bash bench/build_llama_server.sh      # once
    .venv/bin/python -m bench.record_llama_server [--gguf FILE]

Starts the server built by bench/build_llama_server.sh on the default GGUF, greedy, and keeps each answer as the
server sent it (its SSE `data:` payloads in order), with the server's build and the requests: a chat stream with
logprobs, the same with post-sampling probabilities, /apply-template, /tokenize (`with_pieces` crashed this build on
the split emoji), and a text completion whose prompt is the chat's template text followed by the reply's first
token ids (how webchat sends a branch; webchat.serve.remote.engine).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, Server, default_gguf, find_llama_server, free_port

OUT = ROOT / "tests" / "fixtures" / "llama_server.json"
QUESTION = [{"role": "user", "content": "Reply with the words café and naïve, then a coffee emoji."}]


def sse(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    with client.stream("POST", path, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line[6:] != "[DONE]":
                out.append(json.loads(line[6:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF to serve (default: webchat's default model)")
    args = ap.parse_args()
    gguf = args.gguf or default_gguf()
    port = free_port()
    argv = [str(find_llama_server(None)), "-m", str(gguf), "--port", str(port), "-c", "2048", "-t", "2"]
    with Server("llama-server", argv, port):
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        build = client.get("/props").json().get("build_info")
        chat = {
            "messages": QUESTION,
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 3,
        }
        chat_stream = sse(client, "/v1/chat/completions", chat)
        post = {**chat, "max_tokens": 4, "post_sampling_probs": True}
        template = client.post("/apply-template", json={"messages": QUESTION}).json()
        head = [
            e["id"]
            for c in chat_stream
            for ch in c.get("choices", [])
            for e in ((ch.get("logprobs") or {}).get("content") or [])
        ][:3]
        completion = {
            "prompt": [template["prompt"], *head],
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "logprobs": 3,
        }
        record = {
            "build_info": build,
            "gguf": gguf.name,
            "recorded_by": "bench/record_llama_server.py",
            "chat": {"request": chat, "chunks": chat_stream},
            "chat_post_sampling": {"request": post, "chunks": sse(client, "/v1/chat/completions", post)},
            "apply_template": {"request": {"messages": QUESTION}, "response": template},
            "tokenize": {
                "request": {"content": " café naïve ☕"},
                "response": client.post("/tokenize", json={"content": " café naïve ☕"}).json(),
            },
            "completion_after_ids": {"request": completion, "chunks": sse(client, "/v1/completions", completion)},
        }
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n")
        print(f"recorded llama-server {build} on {gguf.name} into {OUT}")


if __name__ == "__main__":
    main()
