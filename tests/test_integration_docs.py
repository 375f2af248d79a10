"""Each integration page's example runs as printed (docs/integrations/*.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs" / "integrations"
NEEDS = {"lightning": ["lightning"], "transformers": ["transformers", "accelerate"], "accelerate": ["accelerate"]}


def example(page: str) -> str:
    """The first python block after the page's "## Example" heading."""
    text = (DOCS / f"{page}.md").read_text()
    found = re.search(r"^## Example.*?^```python\n(.*?)^```", text, re.S | re.M)
    assert found, f"{page}.md has no example"
    return found.group(1)


@pytest.mark.parametrize("page", sorted(NEEDS))
def test_the_example_runs_as_printed(page, tmp_path, monkeypatch):
    for package in NEEDS[page]:
        pytest.importorskip(package)
    monkeypatch.chdir(tmp_path)  # (it writes its checkpoints where it runs)
    exec(compile(example(page), str(DOCS / f"{page}.md"), "exec"), {"__name__": "__main__"})
