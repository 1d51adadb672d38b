"""lm-evaluation-harness through webchat's API against its own `hf` backend, item by item (issue 41).

One multiple-choice task kept in the repo (bench/lm_eval/: 40 questions in JSON Lines, its task YAML), run twice on
the default model: by lm-eval's `local-completions` model against `webchat serve` (/v1/completions with echo and
logprobs: the log-likelihood of each choice), and by lm-eval's `hf` backend (transformers, float32, the same folder's
weights). Prints each backend's acc, how many items got the same answer, and the largest difference between the two
log-likelihoods of any choice; exits 1 if an item differs.

Offline: the task's data is the local file, both backends read the local model folder, the tokenizer is that folder's
(tokenizer_backend=huggingface), and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set before lm-eval is imported.
lm-eval is not a test or runtime dependency (it pulls 48 packages: datasets, evaluate, scipy, scikit-learn, pandas,
pyarrow, nltk...): install it with `.venv/bin/pip install -e '.[eval]'`, then run
`.venv/bin/python -m bench.lm_eval_parity`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.bench_scoring import start
from bench.common import ROOT as REPO
from bench.common import default_model

TASK = "webchat_tiny_mc"
for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[var] = "1"


def run(model: str, model_args: str) -> dict[int, dict[str, Any]]:
    """Each item's sample (acc, the choices' log-likelihoods) from one lm-eval run, by doc id."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=1, log_samples=True,
                                  task_manager=TaskManager(include_path=str(REPO / "bench" / "lm_eval")))
    assert out is not None
    print(f"{model}: acc {out['results'][TASK]['acc,none']:.4f}", flush=True)
    return {int(s["doc_id"]): s for s in out["samples"][TASK]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the default model)")
    ap.add_argument("--samples", type=Path, default=None, help="write each item's choices' log-likelihoods here")
    ap.add_argument("--exact", action="store_true", help="serve with --exact (default: the server's default precision, "
                    "whose prompt scores are exact by construction since issue 64)")
    args = ap.parse_args()
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("lm-eval is not installed: .venv/bin/pip install -e '.[eval]'", file=sys.stderr)
        return 2
    from webchat.files.gguf_cache import model_name

    model_dir = args.model or default_model()
    os.chdir(REPO)  # the task YAML names its data file relative to the repository
    with tempfile.TemporaryDirectory() as shelf:
        # bench.bench_scoring's: `webchat serve`, waited for, at its default precision unless --exact
        with start(REPO, model_dir, Path(shelf), *(["--exact"] if args.exact else [])) as server:
            api = run("local-completions", f"model={model_name(model_dir)},base_url={server.url}/v1/completions,"
                      f"tokenizer_backend=huggingface,tokenizer={model_dir},tokenized_requests=True,"
                      "num_concurrent=1,max_retries=1")
    ref = run("hf", f"pretrained={model_dir},dtype=float32,device=cpu")
    same = [i for i in ref if api[i]["acc"] == ref[i]["acc"]]
    # resps: per choice [(log-likelihood, is_greedy)]
    lls = [(i, j, float(a[0][0]), float(b[0][0])) for i in sorted(ref)
           for j, (a, b) in enumerate(zip(api[i]["resps"], ref[i]["resps"], strict=True))]
    worst = max(lls, key=lambda x: abs(x[2] - x[3]))
    print(f"items with the same answer: {len(same)} of {len(ref)}; largest |Δ log-likelihood| of a choice "
          f"{abs(worst[2] - worst[3]):.2e} over {len(lls)} choices (item {worst[0]}, choice {worst[1]}: "
          f"{worst[2]:.4f} through the API, {worst[3]:.4f} by hf)")
    if args.samples is not None:
        args.samples.write_text(json.dumps({"api": {i: s["resps"] for i, s in api.items()},
                                            "hf": {i: s["resps"] for i, s in ref.items()}}, default=str))
    for i in sorted(set(ref) - set(same)):
        print(f"  item {i}: local-completions acc {api[i]['acc']}, hf acc {ref[i]['acc']}")
    return 0 if len(same) == len(ref) else 1


if __name__ == "__main__":
    raise SystemExit(main())
