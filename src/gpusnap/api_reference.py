"""docs/api.md, generated from the docstrings of ``gpusnap.__all__`` and of the plug-ins.

``python -m gpusnap.api_reference > docs/api.md`` writes it; a test regenerates it and fails
when the checked-in page differs (a renamed argument, a docstring changed without the page,
a public name without a docstring), so the reference never drifts from the code.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import gpusnap

__all__ = ["MissingDocstring", "render"]

# defaults computed from the machine at import: the page shows what decides them, not this machine's value
MACHINE_DEFAULTS = {"io_threads": "per machine"}
# public subpackages: what ``gpusnap.suspend`` returns, live migration, the warm process pool
SUBPACKAGES = ("gpusnap.moving", "gpusnap.migrate", "gpusnap.pool")
PLUG_INS = ("gpusnap.integrations.lightning", "gpusnap.integrations.transformers", "gpusnap.integrations.accelerate")


class MissingDocstring(ValueError):
    """A public name has no docstring: the reference would show nothing for it."""


_missing: list[str] = []  # (render() collects them all, then raises once)


def _doc(obj: Any, name: str) -> str:
    doc = inspect.getdoc(obj)
    if not doc:
        _missing.append(name)
        return "(no docstring)"
    return doc


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _methods(cls: type, qual: str) -> list[str]:
    out = []
    for name, member in cls.__dict__.items():
        if name.startswith("_") and name not in ("__enter__", "__exit__"):
            continue
        if isinstance(member, property):
            out.append(f"- `{qual}.{name}` (property): {_doc(member, f'{qual}.{name}').splitlines()[0]}")
        elif inspect.isfunction(member) and not name.startswith("_"):
            first = _doc(member, f"{qual}.{name}").splitlines()[0]
            out.append(f"- `{qual}.{name}{_signature(member)}`: {first}")
    return out


def _config_fields() -> list[str]:
    rows = ["| field | default | what |", "|---|---|---|"]
    for f in dataclasses.fields(gpusnap.Config):
        doc = f.metadata.get("doc", "")
        if not doc:
            _missing.append(f"Config.{f.name}")
        default = MACHINE_DEFAULTS.get(f.name, repr(f.default))
        rows.append(f"| `{f.name}` | `{default}` | {doc} |".replace("\n", " "))
    return rows


def _entry(name: str, obj: Any) -> list[str]:
    if not callable(obj):  # a constant
        return [f"### `{name} = {obj!r}`", ""]
    if inspect.isclass(obj):
        # (Config's signature holds machine-computed defaults: its table says what decides them)
        plain = issubclass(obj, BaseException) or obj is gpusnap.Config
        head = f"### `{name}{'' if plain else _signature(obj)}`"
        lines = [head, "", _doc(obj, name), ""]
        if obj is gpusnap.Config:
            lines += _config_fields() + [""]
        methods = _methods(obj, name)
        return lines + (methods + [""] if methods else [])
    return [f"### `{name}{_signature(obj)}`", "", _doc(obj, name), ""]


def render() -> str:
    """The page, as text; :class:`MissingDocstring` names every public name without one."""
    _missing.clear()
    out = ["# API reference", "",
           "Generated from the docstrings by `python -m gpusnap.api_reference > docs/api.md`; "
           "tests/test_api_reference.py fails when this page and the code differ.", "",
           "## `gpusnap`", ""]
    for name in gpusnap.__all__:
        if name == "__version__":
            continue
        out += _entry(name, getattr(gpusnap, name))
    for module_name in (*SUBPACKAGES, *PLUG_INS):
        module = importlib.import_module(module_name)
        out += [f"## `{module_name}`", "", _doc(module, module_name), ""]
        for name in getattr(module, "__all__", ()):
            out += _entry(name, getattr(module, name))
    if _missing:
        raise MissingDocstring(f"no docstring: {', '.join(_missing)}")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
