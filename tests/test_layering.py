"""The package layering docs/architecture.md draws holds: every import points down a layer
(or stays inside its package), and no modules import each other in a circle.

Imports are read from the source (function-level ones included: they are dependencies too;
``if TYPE_CHECKING:`` blocks excluded: they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Top to bottom, as docs/architecture.md draws them: a module may import its own package and
# anything in a lower layer, nothing in its own layer's other packages or above.
LAYERS: list[set[str]] = [
    {"__main__"},
    {"cli"},
    {"bench", "api_reference"},
    {"__init__"},
    {"pool"},
    {"interop", "integrations", "cold_entry", "migrate"},
    {"checkpointer"},
    {"save"},
    {"distributed", "serving", "moving"},
    {"restore"},
    {"capture"},
    {"state", "storage"},
    {"kernels"},
    {"handles", "exit_hooks", "launch_hooks", "host_map", "collector", "thread_priority"},
    {"config", "device", "errors", "fork_safety"},
]
LAYER_OF = {part: depth for depth, parts in enumerate(LAYERS) for part in parts}


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in (SRC / "gpusnap").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _under_type_checking(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def _imports(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """module -> the gpusnap modules it imports (``from pkg import mod`` imports ``pkg.mod``)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text())
        skipped = _under_type_checking(tree)
        for node in ast.walk(tree):
            if id(node) in skipped or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = name.split(".") if is_package else name.split(".")[:-1]
                if node.level:
                    base = base[: len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def _part(module: str) -> str:
    """The package (or top-level module) a module belongs to: ``gpusnap.save.tiers`` -> ``save``."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return _imports(_modules())


def test_every_package_has_a_layer(edges: dict[str, set[str]]) -> None:
    unplaced = sorted({_part(m) for m in edges} - set(LAYER_OF))
    assert unplaced == [], f"place these in LAYERS (and in docs/architecture.md's picture): {unplaced}"


def test_imports_point_down(edges: dict[str, set[str]]) -> None:
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in edges.items()
        for target in targets
        if _part(module) != _part(target) and LAYER_OF.get(_part(target), -1) <= LAYER_OF.get(_part(module), -1)
    )
    assert upward == [], "imports that do not point to a lower layer:\n" + "\n".join(upward)


def test_no_import_circles(edges: dict[str, set[str]]) -> None:
    assert _cycles(edges) == []


def test_the_checker_sees_a_circle_and_an_upward_import() -> None:
    """(The checks above can fail.)"""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert LAYER_OF["storage"] > LAYER_OF["capture"] > LAYER_OF["save"] > LAYER_OF["checkpointer"]


def test_the_architecture_page_draws_every_layer() -> None:
    page = (SRC.parent / "docs" / "architecture.md").read_text()
    picture = page.split("```")[1]  # the first code block
    missing = sorted(part for part in LAYER_OF if part not in picture)
    assert missing == [], f"docs/architecture.md's picture lacks {missing}"
