"""Every measured figure quoted in README.md and docs/ appears in BENCHMARKS.md's head table.

A figure is a number followed by a unit of time, rate, CPU time, a ratio (``3.4x``) or a
percentage, outside fenced code blocks and inline code. A doc that wants to quote a
measurement quotes the head table's figure; anything else is said without the number.
ALLOWED names, per page, the numbers the pattern catches that are not measurements
(configuration defaults, timeouts, design bounds), each with its reason.

docs/api.md is checked too: the figures of docstrings and Config's field docs reach it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEAD_TITLE = "## Today's numbers"

_NUMBER = r"[-+±~]?\d+(?:\.\d+)?"
_JOIN = r"\s*(?:-|–|to|/|and)\s*"
_UNIT = (r"(?:\s*(?:GB/s|GiB/s|MB/s|MiB/s|TB/s|CPU-s(?:econds)?|ms|µs|us|ns|seconds?|minutes?|"
         r"hours?|s(?![/-])|%)|(?<=\d)(?:x|×))(?!\w)")
FIGURE = re.compile(rf"(?<![\w.]){_NUMBER}(?:{_JOIN}{_NUMBER})*{_UNIT}")
_PARTS = re.compile(r"\s+(?:/|and)\s+")
_FENCE = re.compile(r"^[ \t]*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")

ALLOWED: dict[tuple[str, str], str] = {
    ("README.md", "25 s"): "Config.sigterm_grace_s's default",
    ("docs/architecture.md", "300 s"): "LEASE_TTL_S, the lease's lifetime",
    ("docs/guarantees.md", "300 s"): "LEASE_TTL_S, the lease's lifetime",
    ("docs/guarantees.md", "25 s"): "Config.sigterm_grace_s's default",
    ("docs/guarantees.md", "30 s"): "Kubernetes' default terminationGracePeriodSeconds",
    ("docs/guarantees.md", "2-4 minutes"): "the tests' hang guards (faults.HANG_S, HOLD_LIMIT)",
    ("docs/bench.md", "10 minutes"): "the time --quick is designed to fit",
    ("docs/bench.md", "480 s"): "--budget-s's default with --quick",
    ("docs/bench.md", "1x"): "the threshold of the 'vs gpusnap' column's definition",
    ("docs/distributed.md", "0.5 ms"): "the store poll's first back-off step",
    ("docs/distributed.md", "20 ms"): "the store poll's longest back-off step",
    ("docs/distributed.md", "0.5 s"): "the poll's probe interval, which bounds noticing a dead rank",
    ("docs/distributed.md", "300 s"): "Config.collective_timeout_s's default",
    ("docs/restore.md", "120 s"): "a reader process's REPLY_TIMEOUT_S",
    ("docs/restore.md", "5 s"): "a reader process's START_TIMEOUT_S",
    ("docs/restore.md", "2 s"): "how long close() waits before it kills reader processes",
    ("docs/serve.md", "90%"): "the most of MemAvailable the server holds",
    ("docs/serve.md", "1 s"): "--poll's default, the connect timeout, the reply timeout's slope",
    ("docs/serve.md", "60 s"): "the client's REPLY_TIMEOUT_S",
    ("docs/serve.md", "10 s"): "the most the client and the server wait for a process to end",
    ("docs/moving.md", "0.5 s"): "migrate.Target's poll_s default with a doorbell",
    ("docs/moving.md", "0.2 s"): "migrate.Target's poll_s default without a doorbell",
    ("docs/api.md", "0.5 s"): "migrate.Target's poll_s default with a doorbell",
    ("docs/api.md", "0.2 s"): "migrate.Target's poll_s default without a doorbell",
}


def prose(markdown: str) -> str:
    """The text outside fenced code blocks and inline code, with line breaks kept (fenced
    lines become empty, so line numbers stay true)."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else _INLINE_CODE.sub(" ", line))
    return "\n".join(lines)


def figures(markdown: str) -> list[tuple[int, str]]:
    """The measured-looking figures of a page's prose: (line, figure with its unit)."""
    text = prose(markdown)
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group().split())) for m in FIGURE.finditer(text)]


def head_table(benchmarks: str) -> str:
    """BENCHMARKS.md's head section: from its title to the next second-level heading."""
    start = benchmarks.index(HEAD_TITLE)
    end = benchmarks.find("\n## ", start + len(HEAD_TITLE))
    return " ".join(benchmarks[start : end if end >= 0 else None].split())


def _present(figure: str, table: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(figure)}(?!\d)", table) is not None


def in_table(figure: str, table: str) -> bool:
    """The figure is in the table as written, or (a list such as ``7.1 / 34.2 ms``) each of
    its numbers is, with the unit."""
    bare = figure.lstrip("~")
    if _present(figure, table) or _present(bare, table):
        return True
    parts = _PARTS.split(bare)
    if len(parts) < 2:
        return False
    unit = FIGURE.fullmatch(parts[-1])
    suffix = parts[-1][len(re.match(_NUMBER, parts[-1]).group()) :] if unit else ""
    return all(_present(p if p == parts[-1] else p + suffix, table) for p in parts)


def pages() -> list[Path]:
    # (docs/api.md too: it is generated from the docstrings and Config's field docs)
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


TABLE = head_table((REPO / "BENCHMARKS.md").read_text())


@pytest.mark.parametrize("page", pages(), ids=_name)
def test_every_figure_of_the_page_is_in_the_head_table(page: Path) -> None:
    name = _name(page)
    missing = [f"  {name}:{line}: {fig}" for line, fig in figures(page.read_text())
               if (name, fig) not in ALLOWED and not in_table(fig, TABLE)]
    assert not missing, ("figures not in BENCHMARKS.md's head table (add the row there, with the "
                         "log's numbers, or say it without the number):\n" + "\n".join(missing))


def test_every_allowed_figure_is_still_on_its_page() -> None:
    stale = [key for key in ALLOWED if key[1] not in {f for _, f in figures((REPO / key[0]).read_text())}]
    assert not stale, f"allowlist entries no longer needed: {stale}"


SAMPLE_TABLE = head_table("""## Today's numbers
| a | 7.1 ms (call 2) / 34.2 ms (call 4) | 0.054 / 0.093 CPU-s | 3.4x | 53% | ~70 ms |
## Next
| b | 99.9 ms |
""")


def test_the_extractor_finds_figures_and_skips_code() -> None:
    sample = ("Saves cost 7.1 / 34.2 ms, a 3.4x gain, 12-15% of a step, 1.5 GB/s and ~70 ms\n"
              "per GiB over 8 steps of 3 sessions, batch 8 x 512, `timeout=25 s`.\n"
              "```python\nx = 99 ms\n```\n0.054 / 0.093 CPU-s, 5.3 and\n5.5 ms\n")
    assert figures(sample) == [(1, "7.1 / 34.2 ms"), (1, "3.4x"), (1, "12-15%"), (1, "1.5 GB/s"),
                               (1, "~70 ms"), (6, "0.054 / 0.093 CPU-s"), (6, "5.3 and 5.5 ms")]


def test_a_figure_absent_from_the_table_fails() -> None:
    for present in ("7.1 / 34.2 ms", "34.2 ms", "0.054 / 0.093 CPU-s", "3.4x", "53%", "~70 ms", "70 ms"):
        assert in_table(present, SAMPLE_TABLE), present
    for absent in ("99.9 ms", "4.2 ms", "7.1 / 35.2 ms", "3.4 ms", "4x", "3%", "1.4x", "0.05 CPU-s"):
        assert not in_table(absent, SAMPLE_TABLE), absent
