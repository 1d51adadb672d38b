"""The layout is the architecture (docs/design.md): no import cycle in the package, the engine free of CUDA code, the
kernels inside the package, and every module named in the design doc."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "webchat"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every webchat module `name` imports anywhere in its file (deferred and TYPE_CHECKING imports too: a cycle hidden
    in a function is still a cycle), resolved to the module; its own ancestor packages are left out (Python loads
    those first for any submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in known] or [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package() -> None:
    assert cycles(graph()) == []


def test_the_engine_imports_no_kernel_and_no_server_code() -> None:
    """Each backend installs what it provides on the model (ops, runner, sampler factory): the engine stays portable."""
    g = graph()
    for name, deps in g.items():
        if name.startswith("webchat.engine"):
            bad = sorted(d for d in deps if d.startswith(("webchat.kernels", "webchat.serve")))
            assert not bad, f"{name} imports {bad}"
        if name.startswith(("webchat.model", "webchat.text")):
            bad = sorted(d for d in deps if d.startswith(("webchat.engine", "webchat.serve")))
            assert not bad, f"{name} imports {bad}"


def test_the_mcp_client_imports_nothing_else_of_webchat() -> None:
    """webchat/mcp/ is wired into the server from outside (the lifespan, the websocket): it knows none of it."""
    for name, deps in graph().items():
        if name.startswith("webchat.mcp"):
            bad = sorted(d for d in deps if not d.startswith("webchat.mcp") and d != "webchat")
            assert not bad, f"{name} imports {bad}"


# the layer order docs/design.md draws, lowest first: a module imports its own layer or those below it
LAYERS = ("gguf", "text", "model", "files", "engine", "kernels", "grammar", "vision", "mcp", "serve", "cli")


def layer(module: str) -> int:
    """The layer of a webchat module (the package itself and `python -m webchat` sit above every layer)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
        return len(LAYERS)
    assert parts[1] in LAYERS, f"{module} is in no layer of {LAYERS}"
    return LAYERS.index(parts[1])


def against_the_order(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in g.items() for b in deps if b != "webchat" and layer(b) > layer(a))


def test_every_import_goes_down_the_layer_order() -> None:
    assert against_the_order(graph()) == []


def test_the_engine_asks_its_parts_and_never_checks_their_types() -> None:
    """The engine composes a Scheduler and a Speculation and asks each sequence's drafter, offers and thinking: no
    isinstance on a drafter (or any other engine part) in webchat/engine/engine.py."""
    parts = {*(PACKAGE / "engine" / "spec").glob("*.py"), PACKAGE / "engine" / "scheduler.py",
             PACKAGE / "engine" / "thinking.py"}
    names = {n.name for f in parts for n in ast.parse(f.read_text()).body if isinstance(n, ast.ClassDef)}
    assert {"SelfDrafter", "SeqDrafter", "Scheduler"} <= names
    tree = ast.parse((PACKAGE / "engine" / "engine.py").read_text())
    checks = [ast.unparse(n) for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance"
              and any(isinstance(a, ast.Name) and a.id in names for a in ast.walk(n.args[1]))]
    assert checks == [], checks


def test_the_order_check_finds_an_arrow_back_up() -> None:
    assert against_the_order({"webchat.model.loader": {"webchat.kernels.cpu.build", "webchat.gguf.blocks"},
                              "webchat.gguf.blocks": set()}) == ["webchat.model.loader -> webchat.kernels.cpu.build"]


def test_the_package_root_holds_its_entry_points_only() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert root == ["__init__.py", "__main__.py"], root
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= set(LAYERS), f"{sorted(folders - set(LAYERS))} are in no layer"


def test_kernels_live_inside_the_package() -> None:
    assert not (ROOT / "gpu").exists()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "package-dir" not in cfg.get("tool", {}).get("setuptools", {})


def test_every_module_is_named_in_the_design_doc() -> None:
    doc = (ROOT / "docs" / "design.md").read_text()
    missing = []
    for name, path in modules().items():
        rel = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py" and not path.read_text().strip().count("\n"):
            continue  # an empty package marker
        if rel not in doc and name not in doc:
            missing.append(rel)
    assert not missing, f"docs/design.md does not name {missing}"
