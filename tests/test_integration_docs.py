"""Each integration page's code runs as printed (docs/integrations/*.md; how: docs_support.py),
when the packages it needs are installed."""

from __future__ import annotations

import pytest
from docs_support import REPO, run_page

pytestmark = pytest.mark.memory_tier  # the code a user reads runs the default path

DOCS = REPO / "docs" / "integrations"
NEEDS = {"lightning": ["lightning"], "transformers": ["transformers", "accelerate"], "accelerate": ["accelerate"]}


@pytest.mark.parametrize("page", sorted(NEEDS))
def test_the_example_runs_as_printed(page, tmp_path):
    for package in NEEDS[page]:
        pytest.importorskip(package)
    done = run_page(DOCS / f"{page}.md", tmp_path)  # (it writes its checkpoints where it runs)
    assert done.returncode == 0, f"{page}.md:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
