"""Running the code blocks of README.md and docs/ as printed (test_docs_code_blocks.py,
test_integration_docs.py).

A page's blocks run in order in one fresh interpreter, in a directory of their own: the
``python`` blocks in one namespace (a later block uses what an earlier one made); a shell
block (``bash``, ``sh``, ``console``) may hold only ``python ...`` and ``gpusnap ...``
commands, ``python`` being this Python: its ``gpusnap`` commands run in the interpreter
(``gpusnap.cli.main``, as the console script does), the rest in bash. A block that cannot
run on a CPU machine says so right above it, visibly in the Markdown source::

    <!-- not run: needs a GPU -->

One rewrite is made: paths under ``/dev/shm/`` go to a fresh directory there (a fast tier
belongs to one durable root, so two runs must not share one), removed afterwards.

Run as a script (``python docs_support.py PAGE SHM``) it is that interpreter.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = frozenset({"python", "py"})
SHELL = frozenset({"bash", "sh", "shell", "console"})
COMMANDS = frozenset({"python", "python3", "gpusnap"})
HANG_S = 600.0  # only a hang guard: a page that takes this long is stuck

_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)[^\n]*\n(?P<code>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.M | re.S,
)
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<why>.*?)\s*-->", re.S)
_SHELL = (f'python() {{ "{sys.executable}" "$@"; }}\npython3() {{ python "$@"; }}\n'
          'gpusnap() { python -m gpusnap "$@"; }\n')


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page: its language, code, the line of its opening fence
    (1-based) and, when a ``not run`` marker stands right above it, the marker's reason."""

    page: Path
    line: int
    lang: str
    code: str
    not_run: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The page's python and shell blocks, in order. A ``not run`` marker that stands above
    anything else is an error (it would hide nothing, or the wrong block)."""
    text = page.read_text()
    found: list[Block] = []
    marked: set[int] = set()
    for m in _FENCE.finditer(text):
        lang = m.group("lang").lower()
        above = text[: m.start()].rstrip()
        start = above.rfind("<!--")
        marker = _NOT_RUN.fullmatch(above, start) if start >= 0 else None
        if marker is not None:
            marked.add(start)
        if lang not in PYTHON | SHELL:
            continue
        line = text.count("\n", 0, m.start()) + 1
        code = "\n".join(s[len(m.group("indent")):] for s in m.group("code").split("\n"))
        found.append(Block(page, line, lang, code, marker.group("why") if marker is not None else None))
    stray = [text.count("\n", 0, m.start()) + 1 for m in _NOT_RUN.finditer(text) if m.start() not in marked]
    if stray:
        raise AssertionError(f"{page.relative_to(REPO)}: a 'not run' marker on line(s) {stray} "
                             "stands above no code block")
    return found


@dataclass(frozen=True)
class Step:
    """One command of a shell block: its words, and as bash source (with its heredoc)."""

    argv: tuple[str, ...]
    source: str


def script(block: Block) -> str:
    """A shell block as bash source (a console block's ``$`` lines)."""
    if block.lang != "console":
        return block.code
    return "".join(f"{s[2:]}\n" for s in block.code.splitlines() if s.startswith("$ "))


def steps(block: Block) -> tuple[list[Step], bool]:
    """The commands of a shell block, and whether the block is plain: commands joined by
    newlines, ``&&`` or ``;``, with quotes and quoted heredocs but no pipes, redirections or
    expansions. (Not plain: it runs in bash as one script.)"""
    lines = script(block).splitlines()
    found: list[Step] = []
    plain = True
    i = 0
    while i < len(lines):
        text = lines[i]
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i]
        i += 1
        lex = shlex.shlex(text, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        try:
            words = list(lex)
        except ValueError:  # (an unclosed quote: bash says what is wrong)
            return found, False
        heredoc = ""
        if len(words) >= 2 and words[-2] in ("<<", "<<-"):
            ending, words = words[-1], words[:-2]
            body = i
            while i < len(lines) and lines[i].strip() != ending:
                i += 1
            heredoc = f" <<'{ending}'\n" + "".join(f"{s}\n" for s in lines[body:i]) + ending
            i += 1
        plain = (plain and not re.search(r"[$`*?~]", text) and not (heredoc and "<<'" not in text)
                 and all(w in ("&&", ";") for w in words if _operator(w)))
        parts = _split(words, ("&&", ";", "||", "|", "&"))
        for n, part in enumerate(parts):
            argv = tuple(w for w in part if not _operator(w))
            if argv:
                found.append(Step(argv, shlex.join(argv) + (heredoc if n == len(parts) - 1 else "")))
    return found, plain


def _operator(word: str) -> bool:
    return bool(word) and set(word) <= set("();<>|&")


def _split(words: list[str], separators: tuple[str, ...]) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for w in words:
        if w in separators:
            parts.append([])
        else:
            parts[-1].append(w)
    return parts


def foreign_commands(block: Block) -> list[str]:
    """Commands of a shell block that are neither ``python`` nor ``gpusnap``."""
    return [" ".join(s.argv) for s in steps(block)[0] if s.argv[0] not in COMMANDS]


def run_page(page: Path, where: Path) -> subprocess.CompletedProcess[str]:
    """Run ``page``'s blocks (:func:`run_blocks`) in a fresh interpreter, in ``where``."""
    shm_parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    shm = tempfile.mkdtemp(prefix="gpusnap-docs-", dir=shm_parent)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    try:
        return subprocess.run([sys.executable, __file__, str(page), shm], cwd=where, env=env,
                              capture_output=True, text=True, timeout=HANG_S)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def run_blocks(page: Path, shm: str) -> None:
    """Every block of ``page`` not marked ``not run``, in order, here."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    for block in blocks(page):
        if block.not_run is not None:
            print(f"--- {block.where}: not run: {block.not_run}", flush=True)
            continue
        code = block.code.replace("/dev/shm/", f"{shm}/")
        print(f"--- {block.where} ({block.lang})", flush=True)
        if block.lang in PYTHON:  # (blank lines first: a traceback names the page's own line)
            exec(compile("\n" * block.line + code, str(block.page), "exec"), namespace)
            continue
        foreign = foreign_commands(block)
        if foreign:
            raise AssertionError(f"{block.where}: only python and gpusnap commands run here, not {foreign}; "
                                 "mark the block '<!-- not run: why -->' if it cannot run")
        _run_shell(block, code)


def _run_shell(block: Block, code: str) -> None:
    """A plain block's ``gpusnap`` commands run in this interpreter (``gpusnap.cli.main``,
    what the console script calls: no torch import each), its ``python`` commands in bash;
    a block that is not plain, in bash as one script."""
    block = replace(block, code=code)
    found, plain = steps(block)
    for step in found if plain else [Step(("bash",), script(block))]:
        if plain and step.argv[0] == "gpusnap":
            from gpusnap.cli.main import main

            status = main(list(step.argv[1:]))
        else:
            status = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", _SHELL + step.source]).returncode
        if status != 0:
            raise AssertionError(f"{block.where}: `{' '.join(step.argv)}` exited {status}")


if __name__ == "__main__":
    run_blocks(Path(sys.argv[1]), sys.argv[2])
