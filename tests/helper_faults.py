"""Faults of a promotion helper's own (``tests/test_promotion_process.py``): a wrapper put in
place of ``sys.executable`` makes the helper call :func:`arm` before it serves, and the
helper's promotions then fail in a way the program's threads would not."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def arm() -> None:
    from gpusnap.storage import promote_worker

    def failing(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("injected into the helper by the test")

    promote_worker.promote = failing  # type: ignore[assignment]


def faulty_python(where: Path) -> str:
    """An executable that runs this interpreter as asked, arming the helper it starts."""
    path = where / "python-arming-the-helper"
    path.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"real = {sys.executable!r}\n"
        "args = sys.argv[1:]\n"
        "args[-1] = args[-1].replace('\\nmain(', '\\n__import__(\"helper_faults\").arm()\\nmain(', 1)\n"
        "os.execv(real, [real, *args])\n"
    )
    os.chmod(path, 0o700)
    return str(path)
