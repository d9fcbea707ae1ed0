"""Imports point down only (ARCHITECTURE.md): every `quickdraft` module, late imports inside
functions included, imports only from its own layer or the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "quickdraft"

# The layers, top first; a module may import its own layer and everything below.
LAYERS = [
    {"cli", "__main__"},  # __main__: `python -m quickdraft` runs the cli
    {"server", "bench", "train", "deploy"},
    {"__init__"},  # the package's public re-exports (LLM, Engine, SamplingParams, ...)
    {"llm"},
    {"engine"},
    {"policy", "proposers", "compile", "aot", "parallel"},
    {"model", "kernels", "verify", "sampling", "constraints", "tree", "cache", "prefix_cache", "metrics"},
    {"config", "paths"},
    {"errors"},
]
RANK = {name: len(LAYERS) - i for i, layer in enumerate(LAYERS) for name in layer}


def _unit(parts: list[str]) -> str:
    """The layer unit of a dotted module path inside quickdraft: its first component."""
    return parts[0] if parts and parts[0] else "__init__"


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported unit, line) for every quickdraft import in `path`."""
    module = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(module[:-1]) if module[-1] != "__init__" else list(module[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = base + (node.module.split(".") if node.module else [])
                if not target:  # `from .. import X` at the top: X is a module or a re-export
                    names = [a.name for a in node.names]
                    found += [(n if n in RANK else "__init__", node.lineno) for n in names]
                    continue
                found.append((_unit(target), node.lineno))
            elif node.module and node.module.split(".")[0] == "quickdraft":
                found.append((_unit(node.module.split(".")[1:]), node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "quickdraft":
                    found.append((_unit(alias.name.split(".")[1:]), node.lineno))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    own = _unit(list(path.relative_to(PACKAGE).with_suffix("").parts))
    assert own in RANK, f"{own} is in no layer: add it to ARCHITECTURE.md and LAYERS"
    upward = [(unit, line) for unit, line in _imports(path) if unit in RANK and RANK[unit] > RANK[own]]
    assert not upward, f"{path.relative_to(PACKAGE)} imports upward: {upward}"


def test_commands_never_import_the_cli_package():
    for path in (PACKAGE / "cli").glob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
                assert all(a.name == "common" for a in node.names), f"{path.name} imports from cli/__init__"


def test_config_imports_only_errors():
    units = {unit for unit, _ in _imports(PACKAGE / "config.py")}
    assert units <= {"errors"}, units


def _module_imports(path: Path) -> set[str]:
    """The quickdraft modules `path` imports (dotted, relative to the package; late imports
    included): `from . import x` names module x when it exists, else the package itself."""
    module = list(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module[:-1]
    found = set()

    def add(parts: list[str], names: list[str] = ()) -> None:
        for name in names:
            if (PACKAGE.joinpath(*parts, name + ".py")).exists() or (PACKAGE.joinpath(*parts, name)).is_dir():
                found.add(".".join(parts + [name]))
                break
        else:
            found.add(".".join(parts) or "__init__")

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                parts = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "quickdraft":
                parts = node.module.split(".")[1:]
            else:
                continue
            if node.module is None:
                for alias in node.names:
                    add(parts, [alias.name])
            else:
                add(parts)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "quickdraft":
                    add(alias.name.split(".")[1:])
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports; a package stands for its __init__."""
    def name(p: Path) -> str:
        parts = list(p.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        return ".".join(parts) or "__init__"

    nodes = {name(p): p for p in MODULES}
    return {n: {m for m in _module_imports(p) if m in nodes and m != n} for n, p in nodes.items()}


def test_no_import_cycles():
    """No two modules import each other, directly or around a circle, same-layer ones included
    (a package's __init__ re-exporting its own modules excepted: that edge points into it)."""
    graph = _graph()
    for pkg in graph:  # `pkg/__init__` importing its own submodules is how a package re-exports
        graph[pkg] = {m for m in graph[pkg] if not (m.startswith(pkg + ".") or pkg == "__init__")}
    state: dict[str, int] = {}
    cycles = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m] if m in stack else [n, m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
