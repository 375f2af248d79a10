"""Every code block of README.md and docs/ runs as printed, on CPU (how: docs_support.py).

The integration pages (docs/integrations/) are run by test_integration_docs.py, which skips
them when their optional packages are missing. A block that cannot run here is marked
``<!-- not run: why -->`` right above it; each is reported as a skip with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_support import REPO, Block, blocks, pages, run_page

pytestmark = pytest.mark.memory_tier  # the code a user reads runs the default path

INTEGRATIONS = REPO / "docs" / "integrations"
MAX_NOT_RUN = 8  # each one is a page that may have gone stale: make blocks run instead


def _ours(page: Path) -> bool:
    return INTEGRATIONS not in page.parents


RUN = [p for p in pages() if _ours(p) and any(b.not_run is None for b in blocks(p))]
NOT_RUN = [b for p in pages() for b in blocks(p) if b.not_run is not None]


@pytest.mark.parametrize("page", RUN, ids=lambda p: str(p.relative_to(REPO)))
def test_the_page_runs_as_printed(page: Path, tmp_path: Path) -> None:
    done = run_page(page, tmp_path)
    assert done.returncode == 0, f"{page.relative_to(REPO)}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"


@pytest.mark.parametrize("block", NOT_RUN, ids=lambda b: b.where)
def test_a_block_not_run(block: Block) -> None:
    pytest.skip(f"{block.where}: not run: {block.not_run}")


def test_the_blocks_not_run_are_few_and_say_why() -> None:
    listed = "\n".join(f"  {b.where}: {b.not_run}" for b in NOT_RUN)
    assert all(b.not_run for b in NOT_RUN), f"a 'not run' marker without a reason:\n{listed}"
    assert len(NOT_RUN) <= MAX_NOT_RUN, f"{len(NOT_RUN)} blocks are not run (at most {MAX_NOT_RUN}):\n{listed}"


def test_every_integration_page_with_code_is_run_there() -> None:
    from test_integration_docs import NEEDS

    runnable = {p for p in pages() if not _ours(p) and any(b.not_run is None for b in blocks(p))}
    assert runnable <= {INTEGRATIONS / f"{name}.md" for name in NEEDS}
