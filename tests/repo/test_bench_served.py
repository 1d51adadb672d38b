"""`python -m bench.bench_served` end to end against stand-in servers (tests/bench_standin.py): several files in one
run, both webchat precisions where the checkout has `--exact`, a plain note where it has not, and the weights a token
reads; and what the speculation comparison (bench/served_speculation.py) prints from an auto server's /api/info."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from bench import served_speculation
from bench.draftable_share import Followers, guess, guessed, oracle_speed
from bench.fidelity_llama_cpp import Agreement, wide_row
from bench.served_files import matrix_bytes, precision_of
from bench.served_prompts import ASKS, SETS, SUBJECTS, open_chat
from bench.served_speculation import FILL_AT, Section, ceiling, fill, report
from webchat.engine.spec.rates import MAX_AUTO_DRAFT
from webchat.engine.spec.verify_cost import VerifyCost

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parents[1] / "bench_standin.py"


def tiny_gguf(path: Path, tied: bool) -> Path:
    """A GGUF with what the bench reads of one: the end-of-sequence id, an embedding, a matrix, a head unless tied."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float16))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((128, 64), dtype=np.float32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((100, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_matrix_bytes_counts_the_head_not_the_embedding_rows(tmp_path: Path) -> None:
    untied = tiny_gguf(tmp_path / "untied.gguf", tied=False)
    tied = tiny_gguf(tmp_path / "tied.gguf", tied=True)
    assert matrix_bytes(untied) == 128 * 64 * 4 + 100 * 64 * 4  # ffn_up + output; the embedding is read by the row
    assert matrix_bytes(tied) == 128 * 64 * 4 + 100 * 64 * 2  # ffn_up + the float16 embedding as the head


def standin_checkout(tmp_path: Path) -> tuple[Path, Path]:
    """A folder whose `python -m webchat.cli` is the stand-in, and a stand-in llama-server binary."""
    src = tmp_path / "checkout"
    (src / "webchat").mkdir(parents=True)
    (src / "webchat" / "__init__.py").write_text("")
    (src / "webchat" / "cli.py").write_text(f"import runpy\nrunpy.run_path({str(STANDIN)!r}, run_name='__main__')\n")
    (src / "webchat" / "gguf_path.py").write_text(  # the conversion the bench asks for before its rounds, noted
        "def model_folder(path):\n"
        f"    with open({str(src / 'converted.txt')!r}, 'a') as f:\n"
        "        f.write(path.name + '\\n')\n")
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {STANDIN} llama \"$@\"\n")
    binary.chmod(0o755)
    return src, binary


def run_bench(tmp_path: Path, exact: bool, *extra: str) -> subprocess.CompletedProcess[str]:
    src, binary = standin_checkout(tmp_path)
    files = [tiny_gguf(tmp_path / "a.gguf", tied=False), tiny_gguf(tmp_path / "b.gguf", tied=True)]
    argv = [sys.executable, "-m", "bench.bench_served", "--src", str(src), "--llama-server", str(binary),
            "--rounds", "1", "--tokens", "4", "--clients", "1,2", *extra]
    for f in files:
        argv += ["--gguf", str(f)]
    env = {"PATH": "/usr/bin:/bin", "STANDIN_EXACT": "1" if exact else "0", "HOME": str(tmp_path)}
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_both_precisions_and_llama_server_per_file(tmp_path: Path) -> None:
    out = run_bench(tmp_path, exact=True)
    assert out.returncode == 0, out.stderr[-2000:]
    header = ("| section | webchat (int8) | webchat --exact (exact) | llama-server | webchat / llama "
              "| webchat --exact / llama |")
    assert out.stdout.count(header) == 2, out.stdout  # one table per file
    assert "a.gguf" in out.stdout and "b.gguf" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 2 client(s): aggregate |")]
    assert len(rows) == 2 and all(len(r.split("|")) == 2 + 5 + 1 for r in rows), rows  # title, 3 servers, 2 ratios
    weights = [line for line in out.stdout.splitlines() if line.startswith("weights read a token")]
    assert len(weights) == 2 and all("webchat --exact" in w and "llama-server" in w for w in weights), weights
    assert (tmp_path / "checkout" / "converted.txt").read_text().split() == ["a.gguf", "b.gguf"]  # each once


def test_a_checkout_without_exact_says_so_and_runs_its_default(tmp_path: Path) -> None:
    out = run_bench(tmp_path, exact=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "has no --exact" in out.stdout and "webchat --exact" not in out.stdout
    assert out.stdout.count("| section | webchat (not reported) | llama-server | webchat / llama |") == 2


def test_the_kv_pool_goes_to_every_webchat_server_and_not_llama_server(tmp_path: Path) -> None:
    out = run_bench(tmp_path, True, "--kv-pool", "9000", "--spec-none")
    assert out.returncode == 0, out.stderr[-2000:]
    served = (tmp_path / "checkout" / "served.txt").read_text().splitlines()
    assert len(served) == 2 * 3  # two files, three webchat servers each (default, --speculative none, --exact)
    assert all(" --kv-pool 9000" in line for line in served), served
    assert sum("--speculative none" in line for line in served) == 2 and sum("--exact" in line for line in served) == 2


def test_asking_for_exact_alone_without_the_flag_is_refused_by_name(tmp_path: Path) -> None:
    out = run_bench(tmp_path, False, "--precision", "exact")
    assert out.returncode != 0 and "has no --exact" in out.stderr, out.stderr[-2000:]


def test_the_speculation_report_prints_the_curve_and_how_the_plans_came_true(
        capsys: pytest.CaptureFixture[str]) -> None:
    def sec(tps: float) -> dict[str, Section]:
        return {"copy c1": Section(int(tps), 1.0, ["same"], {"offers": 10, "granted": 4, "drafted": 20,
                                                              "accepted": 15})}

    curve = {"cost": {"forward_ms": {"1": 5.0, "4": 8.0, "6": 12.0}, "slope_ms_per_row": 1.8, "scale": 1.0},
             "between_steps_ms": 0.4, "payoff": {"1": 0.7, "4": 0.873}}
    report(["none", "auto"], ["copy"], [1], {"none": sec(100), "auto": sec(150)}, {"none": [sec(100)],
                                                                                   "auto": [sec(150)]}, curve)
    out = capsys.readouterr().out
    assert "| copy | 1 | 100.0 | 150.0 | 1.50x | 1.50 |" in out
    assert "drafted in 40% of 10, accepted 15/20 (75%)" in out
    assert "a 5-row verify ~ 2.00 one-row steps" in out
    assert f"one client's decode reaches at most {ceiling(curve, 1):.2f}x of none's" in out
    assert "(payoff per batch size of decode rows, the factor on later plans' expected rates): 1: 0.70, 4: 0.87" in out


def test_the_ceiling_is_a_verify_rows_cost_against_a_decode_rows() -> None:
    """Every draft accepted: one client's tokens per ms at the best draft length over its tokens per ms without."""
    linear = {"cost": {"forward_ms": {"1": 4.0, "17": 20.0}}, "between_steps_ms": 0.0}  # a verify row costs 1 ms
    assert ceiling(linear, 1) == pytest.approx(4.0 / (20.0 / 17))  # 16 drafts (MAX_AUTO_DRAFT) pay best
    gap = {"cost": {"forward_ms": {"1": 4.0, "17": 20.0}}, "between_steps_ms": 2.0}  # time between steps, per step
    assert ceiling(gap, 1) == pytest.approx(6.0 / (22.0 / 17))
    rows_alike = {"cost": {"forward_ms": {"1": 4.0, "64": 256.0}}, "between_steps_ms": 0.0}  # a row costs 4 ms
    assert ceiling(rows_alike, 1) == pytest.approx(1.0)  # compute-bound from the first row: drafts cannot pay
    assert ceiling(rows_alike, 16) == pytest.approx(1.0)


def test_the_fill_asks_other_prompts_of_the_set_four_at_a_time_and_none_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """--spec-fill: n prompts none asked before (a repeated one would let auto copy its reply), in sections of <= 4."""
    sent: list[list[list[dict[str, str]]]] = []
    monkeypatch.setattr(served_speculation, "section", lambda server, chats, body: sent.append(chats))
    asked = {json.dumps(SETS["code"](FILL_AT + 1))}  # asked already: skipped
    assert fill(None, "code", 6, {}, asked) == 6  # type: ignore[arg-type]
    chats = [c for s in sent for c in s]
    assert [len(s) for s in sent] == [4, 2]
    assert len({json.dumps(c) for c in chats}) == 6 and SETS["code"](FILL_AT + 1) not in chats
    assert chats[0] == SETS["code"](FILL_AT) and all(json.dumps(c) in asked for c in chats)


@pytest.mark.parametrize("argv", [["--spec-fill", "4"], ["--spec-paired", "2", "--spec-fill", "-1"]])
def test_a_fill_without_pairs_or_below_zero_is_refused_by_name(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    served_speculation.add_arguments(parser)
    args = parser.parse_args(["--speculation", *argv])
    with pytest.raises(SystemExit, match="--spec-fill must be 0"):
        served_speculation.main(args, Path("unread.gguf"))


def test_the_oracle_guesses_the_longest_suffixs_most_frequent_follower() -> None:
    seen = Followers()
    seen.add_all([1, 2, 3, 9, 1, 2, 3, 9, 5, 2, 3, 7])  # (2, 3) -> 9, 9, 7; (1, 2, 3) -> 9, 9
    assert guess([8, 2, 3], [seen]) == 9  # the most frequent follower of the longest suffix seen
    assert guess([5, 2, 3], [seen]) == 7  # (5, 2, 3) -> 7 is longer than (2, 3)'s majority
    assert guess([4, 4], [seen]) is None
    # a reply that copies its prompt: guessed once two tokens of the copy are in (its first two never)
    prompt = [10, 11, 12, 13, 14, 15, 16]
    assert guessed(prompt + [0], [11, 12, 13, 14], None) == [False, False, True, True]
    other = Followers()
    other.add_all([0, 11, 12])  # another reply's: 0 -> 11 after (.., 0)
    assert guessed(prompt + [0], [11, 12, 13, 14], other)[:2] == [False, True]


def test_the_oracle_speed_verifies_exactly_each_run_of_right_guesses() -> None:
    flat = VerifyCost({1: 4.0, 64: 4.0 + 63 * 1.0})  # a verify row costs a quarter of a step
    assert oracle_speed([False] * 10, flat) == pytest.approx(1.0)  # nothing guessed: a step a token
    # a run of 3 guessed after a miss: steps emit [miss], [3 guessed + 1]: 5 tokens in 4 + 7 ms against 5 * 4 ms
    assert oracle_speed([False, True, True, True, False], flat) == pytest.approx(20.0 / 11.0)
    long = [True] * (MAX_AUTO_DRAFT + 3)  # a run past the draft cap takes a second step
    steps = flat.forward_ms(1 + MAX_AUTO_DRAFT) + flat.forward_ms(3)
    assert oracle_speed(long, flat) == pytest.approx(len(long) * 4.0 / steps)


def test_the_precision_label_names_the_kernels_the_server_took() -> None:
    """--isa avx2 forces webchat's kernels through the environment: the table's label is what /api/info says ran."""
    assert precision_of({"precision": "int8"}) == "int8"
    assert precision_of({}) == "not reported"
    took = {"precision": "int8", "cpu_kernels": {"path": "avx2", "vnni": False}}
    assert precision_of(took) == "int8, avx2 kernels without VNNI"
    assert precision_of({"precision": "exact", "cpu_kernels": {"path": "avx512", "vnni": True}}) == (
        "exact, avx512 kernels with VNNI")


def test_the_fidelity_scripts_wide_table_counts_what_each_side_kept() -> None:
    """bench.fidelity_llama_cpp --more: continuations kept whole, the mean tokens before the first divergence (a
    whole one counts all its tokens), the first token's |Δp| median and max, the agreed prefixes' largest."""
    marks = [Agreement(None, True, 0.01, 0.02), Agreement(4, False, 0.03, 0.2), Agreement(0, False, None, 0.05)]
    cells = [c.strip() for c in wide_row("webchat", "int8", marks, 32).split("|")[1:-1]]
    assert cells == ["webchat", "int8", "1/3", "12.0", "2.0e-02 / 3.0e-02", "2.0e-01"]


@pytest.mark.parametrize("past", [-1, 1])
def test_the_fidelity_script_refuses_more_prompts_than_it_has(past: int) -> None:
    """--more past the distinct open questions would count repeated prompts as new ones: refused by name, before any
    server or model starts."""
    distinct = len(ASKS) * len(SUBJECTS)
    assert len({open_chat(i)[0]["content"] for i in range(distinct)}) == distinct  # ... and no more than that
    more = -1 if past < 0 else distinct + 1
    done = subprocess.run([sys.executable, "-m", "bench.fidelity_llama_cpp", "--more", str(more)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"--more must be 0 to {distinct} (the distinct open questions), got {more}" in done.stderr
