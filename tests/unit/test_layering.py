"""The core imports nothing above it, and its modules form no import circle.

Layers (lowest first): ``knittrans`` (what a user imports into their RL stack) <- ``baselines``, ``workloads``,
``triton_kernels`` <- ``repro``. A policy, a task or a model reaches the core as an argument, never as an import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UPWARD = ("baselines", "workloads", "repro")


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every module ``path`` imports (at any depth: lazy imports inside functions count too), with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
    return out


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def test_knittrans_imports_nothing_from_baselines_workloads_or_repro():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {m}"
           for p in sorted((ROOT / "knittrans").rglob("*.py"))
           for m, line in _imports(p) if m.split(".")[0] in UPWARD]
    assert not bad, "the core must not depend upward (pass policies/tasks in instead):\n" + "\n".join(bad)


def test_knittrans_modules_form_no_import_circle():
    """Module-level imports only (a lazy import inside a function cannot deadlock an import), resolved to the
    ``knittrans`` module they name; a package's ``__init__`` counts as importing what it re-exports."""
    files = {_module(p): p for p in (ROOT / "knittrans").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.If):  # `if TYPE_CHECKING:` blocks never run
                continue
            for n in names:
                if n in files and n != mod:
                    deps.add(n)
        graph[mod] = deps
    # a package __init__ importing its own submodules is how packages work; only count edges between modules
    # where neither is an ancestor package of the other
    def related(a: str, b: str) -> bool:
        return a.startswith(b + ".") or b.startswith(a + ".")

    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if related(m, d):
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import circles in knittrans:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_repro_table_script_is_over_400_lines():
    long = {p.name: n for p in (ROOT / "repro").glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"repro scripts must stay readable (<= 400 lines): {long}"


def test_no_test_or_gate_imports_private_names_of_a_repro_script():
    bad = []
    for p in [*(ROOT / "tests").rglob("*.py"), *(ROOT / "repro").glob("*.py")]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("repro"):
                bad += [f"{p.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, "private names of repro scripts are not an API:\n" + "\n".join(bad)
