"""The plug-ins keep the base install light: importing gpusnap imports no framework, each
integration names the extra that installs its own, and the extras exist."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "gpusnap"
FRAMEWORKS = {"lightning": "lightning", "transformers": "transformers", "accelerate": "accelerate"}


def _imported(path: Path) -> set[str]:
    """Top-level packages a module imports when it is imported (not inside functions)."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return names


def test_only_the_integrations_import_a_framework():
    outside = [p for p in SRC.rglob("*.py") if "integrations" not in p.relative_to(SRC).parts]
    offenders = {str(p.relative_to(SRC)): sorted(_imported(p) & set(FRAMEWORKS)) for p in outside}
    assert not {k: v for k, v in offenders.items() if v}
    assert not _imported(SRC / "integrations" / "__init__.py") & set(FRAMEWORKS)


@pytest.mark.parametrize("extra", sorted(FRAMEWORKS))
def test_a_missing_framework_names_its_extra(extra, monkeypatch):
    monkeypatch.setitem(sys.modules, FRAMEWORKS[extra], None)  # import of it now fails
    for name in [m for m in sys.modules if m.startswith(f"gpusnap.integrations.{extra}")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=rf"pip install 'gpusnap\[{extra}\]'"):
        importlib.import_module(f"gpusnap.integrations.{extra}")


def test_the_extras_install_the_frameworks_and_the_tests_get_them():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((SRC.parent.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, package in FRAMEWORKS.items():
        assert any(r.startswith(package) for r in extras[extra])
        assert any(r.startswith(package) for r in extras["test"])
