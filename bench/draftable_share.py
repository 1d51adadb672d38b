"""How much of a reply any suffix drafter could have drafted: the bound the draft source puts on speculation.

    .venv/bin/python -m bench.draftable_share [--sets copy,code,open] [--prompts 8] [--fill 24]

For each prompt set of the served benchmark (bench/served_prompts.py), greedy replies of the default model (or
--model) to --prompts prompts, and first to --fill other prompts of the set: what a served engine's index holds of its
earlier requests after a while. For each token of a measured reply, an oracle drafter guesses it from what came before:
the longest suffix (SUFFIX_MAX down to 2 tokens) of the context that occurred before, and the token that followed it
most often (SuffixDecoding's choice, Oliaro et al. 2024); `own` looks over the prompt and the reply so far, `with
others` over the other replies too (the engine-wide index of vLLM's `suffix` method and of `--speculative auto`).

Printed per set: the median share of reply tokens the oracle guessed right (each way), and the decode speed it
allows against none's on this machine: each step verifies exactly the run of right guesses that starts at its token
(at most MAX_AUTO_DRAFT, no wrong draft ever granted) and emits it and one more token, costing a forward of that many
rows on the verify-cost curve measured here (webchat.engine.spec.verify_cost, as the server measures it at warm-up);
every
token the oracle misses ends a step. No draft source of the suffix kind (n-gram, prompt lookup, suffix trees) with
this guess gets past it; the auto mode's measured drafting (bench.bench_served --speculation) can be read against it.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path

from bench.common import default_model, table_header, table_row
from bench.served_prompts import SETS
from bench.served_speculation import FILL_AT  # the fill's prompts: bench_served --spec-fill's
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings
from webchat.engine.spec import verify_cost
from webchat.engine.spec.rates import MAX_AUTO_DRAFT
from webchat.kernels.backend import load_model
from webchat.text.tokenizer import Tokenizer

SUFFIX_MAX = 8  # the longest suffix looked up
OPEN_TOKENS = 96  # open questions' reply length (bench_served --tokens)


class Followers:
    """For every run of 2..SUFFIX_MAX tokens seen, how often each token followed it."""

    def __init__(self) -> None:
        self.next: dict[tuple[int, ...], Counter[int]] = {}

    def add(self, tokens: list[int], end: int) -> None:
        """tokens[end - 1] as the follower of each run that ends just before it."""
        for n in range(2, SUFFIX_MAX + 1):
            if end - 1 - n >= 0:
                self.next.setdefault(tuple(tokens[end - 1 - n : end - 1]), Counter())[tokens[end - 1]] += 1

    def add_all(self, tokens: list[int]) -> None:
        for end in range(3, len(tokens) + 1):
            self.add(tokens, end)


def guess(context: list[int], indexes: list[Followers]) -> int | None:
    """The oracle's draft for the token after context: the longest suffix any index has seen, its most frequent
    follower (ties: the first index's, then the first seen)."""
    for n in range(min(SUFFIX_MAX, len(context)), 1, -1):
        key = tuple(context[-n:])
        seen: Counter[int] = Counter()
        for index in indexes:
            seen.update(index.next.get(key, Counter()))
        if seen:
            return seen.most_common(1)[0][0]
    return None


def reply(gen: Generator, tok: Tokenizer, chat: list[dict[str, str]], max_tokens: int) -> tuple[list[int], list[int]]:
    """The prompt's ids and the greedy reply's, without drafts, from a cold start (no pages or cached prefixes of the
    last reply)."""
    ids = tok.encode(tok.apply_chat_template(chat))
    gen.engine.reset()
    gen.begin_stream(GenerationRequest(prompt_ids=ids, settings=SamplingSettings(temperature=0.0),
                                       max_new_tokens=max_tokens, speculative="none"))
    out: list[int] = []
    while True:
        res = gen.stream()
        out += res.token_ids
        if res.eos:
            return ids, out


def guessed(prompt: list[int], out: list[int], others: Followers | None) -> list[bool]:
    """For each of out's tokens whether the oracle guesses it from the context (and the others' replies, if any)."""
    context, own = list(prompt), Followers()
    own.add_all(context)
    indexes = [own] if others is None else [own, others]
    hits = []
    for token in out:
        hits.append(guess(context, indexes) == token)
        context.append(token)
        own.add(context, len(context))
    return hits


def oracle_speed(hits: list[bool], cost: verify_cost.VerifyCost) -> float:
    """Decode speed against none's when each step verifies exactly the run of right guesses from its token on."""
    i, ms = 0, 0.0
    while i < len(hits):
        run = 0
        while run < MAX_AUTO_DRAFT and i + run < len(hits) and hits[i + run]:
            run += 1
        ms += cost.forward_ms(1 + run)
        i += run + 1
    return len(hits) * cost.forward_ms(1) / ms if ms else 1.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="copy,code,open")
    p.add_argument("--prompts", type=int, default=8, help="measured prompts per set")
    p.add_argument("--fill", type=int, default=24, help="other prompts' replies the `with others` oracle sees")
    p.add_argument("--max-tokens", type=int, default=320, help="cap on copy and code replies (bench_served's)")
    p.add_argument("--model", type=Path, default=None, help="a model directory or GGUF (default: the default model)")
    args = p.parse_args()
    sets = args.sets.split(",")
    if any(s not in SETS for s in sets) or args.prompts < 1 or args.fill < 0:
        raise SystemExit(f"--sets from {list(SETS)} (got {sets}); --prompts at least 1, --fill at least 0")
    path = args.model or default_model()
    model, tok = load_model(path), Tokenizer.from_dir(path)
    gen = Generator(model, tok)
    cost = verify_cost.VerifyCost(verify_cost.measure(model, model.new_pool(2 * verify_cost.CONTEXT)))
    print(f"{path.name}: greedy replies, {args.prompts} measured prompts a set, {args.fill} other prompts' replies "
          f"beside them; suffixes of 2-{SUFFIX_MAX} tokens. Verify cost here: one row {cost.forward_ms(1):.2f} ms, "
          f"{1 + MAX_AUTO_DRAFT} rows {cost.forward_ms(1 + MAX_AUTO_DRAFT):.2f} ms")
    print("\n" + table_header("set", "reply tokens (median)", "guessed from the context", "with others' replies",
                              "oracle decode / none: context / with others", align="lrrrl"), flush=True)
    for name in sets:
        cap = OPEN_TOKENS if name == "open" else args.max_tokens
        others = Followers()
        for i in range(args.fill):
            others.add_all(reply(gen, tok, SETS[name](FILL_AT + i), cap)[1])
        got = []
        for i in range(args.prompts):
            prompt, out = reply(gen, tok, SETS[name](i), cap)
            alone, both = guessed(prompt, out, None), guessed(prompt, out, others)
            got.append((len(out), sum(alone) / len(out), sum(both) / len(out), oracle_speed(alone, cost),
                        oracle_speed(both, cost)))
        med = [statistics.median(g[k] for g in got) for k in range(5)]
        print(table_row(name, f"{med[0]:.0f}", f"{med[1]:.2f}", f"{med[2]:.2f}", f"{med[3]:.2f}x / {med[4]:.2f}x"),
              flush=True)


if __name__ == "__main__":
    main()
