"""Scoring upstream (a `score` on a remote engine): vLLM's `prompt_logprobs`, which webchat's own API also answers.

    a message in its chat → POST /v1/chat/completions {messages, add_generation_prompt: false, prompt_logprobs: k,
                             max_tokens: 1}                       → response.prompt_logprobs (vLLM's chat: top level)
    a pasted text          → POST /v1/completions {prompt: text, prompt_logprobs: k, max_tokens: 1}
                                                                  → choices[0].prompt_logprobs
    prompt_logprobs = [null, {"<id>": {logprob, rank, decoded_token}, ...}, ...]: per position the prompt token first,
    then the top k (vLLM's LogprobsProcessor._make_logprob_dict); the prompt token is among the top k iff rank <= k.
One token generated (vLLM wants max_tokens >= 1) is not part of the score. A token's text is vLLM's decoded_token,
each token decoded on its own: a character split over several tokens shows as U+FFFD in each (the page's search for
the scored message allows for that). The first position has no entry: its text is what the others leave of a pasted
text, and unknown (empty) in a chat, where it is the template's.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

from webchat.engine import events as ev
from webchat.serve.backend import Job
from webchat.serve.remote.capabilities import Capabilities
from webchat.serve.remote.client import Upstream, UpstreamError
from webchat.serve.remote.parse import MAX_ALTERNATIVES, NO_ID, ChunkError, prob_of


def score_request(caps: Capabilities, job: Job) -> tuple[str, dict[str, Any]]:
    """(path, body) of the upstream request that scores the job's prompt."""
    k = job.request.prompt_logprobs or 0
    body: dict[str, Any] = {"model": caps.model, "max_tokens": 1, "temperature": 0, "stream": False,
                            "prompt_logprobs": k}
    if job.messages is None:
        assert job.scoring is not None and job.scoring.text, "a score job without messages scores a text"
        return "/v1/completions", {**body, "prompt": job.scoring.target}
    return "/v1/chat/completions", {**body, "messages": job.messages, "add_generation_prompt": False}


async def score_upstream(up: Upstream, caps: Capabilities, job: Job) -> tuple[list[ev.TokenInfo], int]:
    """The prompt's scored tokens from the upstream, and how many prompt tokens it read."""
    path, body = score_request(caps, job)
    resp = await up.post_json(path, body)
    if not isinstance(resp, dict):
        raise UpstreamError(f"the upstream engine at {up.url} answered {path} with {type(resp).__name__}, not an "
                            "object")
    choices = resp.get("choices")
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    entries = resp.get("prompt_logprobs", first.get("prompt_logprobs"))
    if not isinstance(entries, list) or not entries:
        raise UpstreamError(f"the upstream engine at {up.url} answered {path} without prompt_logprobs: it cannot "
                            "score a prompt")
    text = body.get("prompt") if isinstance(body.get("prompt"), str) else None
    tokens = parse_prompt_logprobs(entries, body["prompt_logprobs"], text)
    usage = resp.get("usage")
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return tokens, count if isinstance(count, int) else len(tokens)


def parse_prompt_logprobs(entries: list[Any], k: int, text: str | None = None) -> list[ev.TokenInfo]:
    """vLLM's prompt_logprobs as the engine's scored prompt (events.PromptTokens): tokens[0] without p; `text`, the
    prompt where it was a text, gives the first token its piece."""
    tokens = [ev.TokenInfo(id=NO_ID, piece="")]
    for i, entry in enumerate(entries[1:], start=1):
        if not isinstance(entry, dict) or not entry:
            raise UpstreamError(f"prompt_logprobs[{i}] is {type(entry).__name__}, not an object of token ids")
        # an upstream that sends 10,000 alternatives: the prompt token and the first 4 * MAX_ALTERNATIVES are read
        items = [(_id(key, i), _logprob(value, i)) for key, value in islice(entry.items(), 1 + 4 * MAX_ALTERNATIVES)]
        tid, own = items[0]
        top = sorted(((t, v) for t, v in items if v["rank"] is not None and v["rank"] <= k), key=lambda x: x[1]["rank"])
        top = top[: min(k, MAX_ALTERNATIVES)]  # an untrusted upstream: never more than were asked for
        tokens.append(ev.TokenInfo(id=tid, piece=own["text"], prob=own["p"], rank=own["rank"],
                                   top=[(t, v["text"], v["p"]) for t, v in top]))
    if text is not None:
        tail = "".join(t.piece for t in tokens[1:])
        tokens[0].piece = text[: len(text) - len(tail)] if text.endswith(tail) else ""
    return tokens


def _id(key: Any, i: int) -> int:
    try:
        tid = int(key)
    except (TypeError, ValueError):
        raise UpstreamError(f"prompt_logprobs[{i}] has the key {str(key)[:40]!r}, not a token id") from None
    return tid if tid >= 0 else NO_ID


def _logprob(value: Any, i: int) -> dict[str, Any]:
    """{p, rank, text} of one {logprob, rank, decoded_token} entry; a logprob above 0, not finite or not a number is
    the upstream's error naming it (as a streamed token's, webchat.serve.remote.parse)."""
    if not isinstance(value, dict) or value.get("logprob") is None:
        raise UpstreamError(f"prompt_logprobs[{i}] holds {str(value)[:80]!r}, not {{logprob, rank, decoded_token}}")
    try:
        p = prob_of({"logprob": value["logprob"]}, f"prompt_logprobs[{i}]")
    except ChunkError as exc:
        raise UpstreamError(f"the upstream's {exc}") from None
    rank = value.get("rank")
    decoded = value.get("decoded_token")
    return {"p": p,
            "rank": rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1 else None,
            "text": decoded if isinstance(decoded, str) else ""}
