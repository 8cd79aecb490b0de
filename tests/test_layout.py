"""The package's import rules (../shared/DESIGN.md), read off the source with ast so they stay true:
no import circle among aurakernel's modules (function-level imports included), only the CLI and
the bench import the trainer, and nothing imports the loose scripts under benchmarks/."""

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "aurakernel"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it (`from pkg import sub` counts as pkg.sub alone
    when sub is a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            subs = {f"{source}.{a.name}" for a in node.names}
            modules = subs & MODULES.keys()
            out |= modules
            if len(modules) < len(subs):   # some of the names are the module's attributes
                out.add(source)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_the_package_modules():
    graph = {m: {i for i in imports_of(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    assert _cycles(graph) == []
    # the check sees function-level imports too: a circle hidden in a function is found
    graph["aurakernel.planner.model"] = graph["aurakernel.planner.model"] | {"aurakernel.agent"}
    assert _cycles(graph)


def _importers(prefix: str, roots=(PACKAGE,)) -> set[str]:
    return {module_name(p) for root in roots for p in root.rglob("*.py")
            if any(i == prefix or i.startswith(prefix + ".") for i in imports_of(p))}


def test_only_the_cli_and_the_bench_import_the_trainer():
    importers = _importers("trainer")
    assert importers, "the CLI builds its workloads from the trainer"
    assert {m for m in importers if m != "aurakernel.cli" and not m.startswith("aurakernel.bench")} == set()


def test_nothing_imports_the_benchmark_scripts():
    assert _importers("benchmarks", roots=(PACKAGE, REPO / "trainer", REPO / "tests")) == set()
