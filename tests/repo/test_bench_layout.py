"""bench/ stays a package that runs as `python -m bench.<script>`: no sys.path edits, no import circle among its
modules, nothing imported from tests/, a README under 400 lines, and every bench command the docs name exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
MODULES = {p.stem: p for p in sorted(BENCH.glob("*.py")) if p.stem != "__init__"}
DOCS = [ROOT / "README.md", BENCH / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imported(path: Path) -> list[tuple[str, int]]:
    """Every module an import statement in `path` names (at any depth, a function's lazy imports included), as the
    dotted name it resolves to, with its line; `from bench import x` gives bench.x."""
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "bench" if node.level else node.module or ""  # a relative import is bench's own
            if node.level and node.module:
                base = f"bench.{node.module}"
            out.append((base, node.lineno))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names if base == "bench"]
    return out


def bench_edges(path: Path) -> set[str]:
    """The bench modules `path` imports, as `bench.x` or (through a path hack) as `x`."""
    edges = set()
    for name, _ in imported(path):
        parts = name.split(".")
        module = parts[1] if parts[0] == "bench" and len(parts) > 1 else parts[0]
        if module in MODULES:
            edges.add(module)
    return edges


def test_no_bench_module_edits_sys_path() -> None:
    found = [f"{p.name}:{node.lineno}" for p in MODULES.values() for node in ast.walk(tree(p))
             if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
             and node.value.id == "sys"]
    assert not found, f"sys.path used in bench/ (run the script as `python -m bench.<script>` instead): {found}"


def test_bench_imports_nothing_from_tests_and_its_own_modules_by_package() -> None:
    """`tests` is the test suite's, and a bench module found without `bench.` was found through a path hack."""
    bad = [f"{p.name}:{line} imports {name}" for p in MODULES.values() for name, line in imported(p)
           if name.split(".")[0] == "tests" or name.split(".")[0] in MODULES]
    assert not bad, bad


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_among_bench_modules() -> None:
    found = cycle({name: bench_edges(p) for name, p in MODULES.items()})
    assert found is None, f"an import circle in bench/: {' -> '.join(found)}"


def test_the_cycle_finder_finds_a_circle_and_passes_a_tree() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_bench_readme_stays_under_400_lines() -> None:
    lines = len((BENCH / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines < 400, f"bench/README.md has {lines} lines: its history belongs in docs/perf-history.md"


MODULE_COMMAND = re.compile(r"-m bench\.(\w+)")
PATH_COMMAND = re.compile(r"(?<![\w./-])bench/([\w./-]*\w)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_bench_command_the_docs_name_exists(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    missing = [f"python -m bench.{m}" for m in MODULE_COMMAND.findall(text) if m not in MODULES]
    missing += [f"bench/{p}" for p in PATH_COMMAND.findall(text) if not (BENCH / p).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} names what bench/ does not have: {sorted(set(missing))}"


def test_the_command_patterns_see_both_forms() -> None:
    text = "`.venv/bin/python -m bench.bench_served --rounds 2`, then `bash bench/make_bench_files.sh`; bench-files/"
    assert MODULE_COMMAND.findall(text) == ["bench_served"]
    assert PATH_COMMAND.findall(text) == ["make_bench_files.sh"]
