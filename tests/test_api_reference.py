"""docs/api.md is what the docstrings say now: a stale page, or a public name without a
docstring, fails here (regenerate with ``python -m gpusnap.api_reference > docs/api.md``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap import api_reference

PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_the_checked_in_reference_is_the_generated_one() -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    assert PAGE.read_text() == api_reference.render(), (
        "docs/api.md is stale: run `python -m gpusnap.api_reference > docs/api.md`"
    )


def test_a_public_name_without_a_docstring_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpusnap

    def undocumented() -> None:
        pass

    monkeypatch.setattr(gpusnap, "undocumented", undocumented, raising=False)
    monkeypatch.setattr(gpusnap, "__all__", [*gpusnap.__all__, "undocumented"])
    monkeypatch.setattr(api_reference, "PLUG_INS", ())
    with pytest.raises(api_reference.MissingDocstring, match="undocumented"):
        api_reference.render()
