"""A backend that fails exactly the k-th mutating step of whatever runs through it.

Used by the fault-injection suite: a clean run records every step a save takes through the
:class:`~gpusnap.storage.backend.Backend` (create a directory, open a temporary file, each
write, each close with its fsync, each rename, each directory sync), then one run per step
fails that step the way real media do, and the test checks what the program saw and that
nothing committed earlier was harmed. Methods the wrapper does not know are passed through,
so backends that grow new methods still work.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["Step", "StepFaultBackend"]


@dataclass(frozen=True)
class Step:
    """One mutating call: ``kind`` (``makedirs``, ``open_write``, ``write``, ``close``,
    ``rename``, ``sync_dir``; ``remove`` when asked for) and the path it touched."""

    kind: str
    path: str


class _Handle:
    def __init__(self, owner: StepFaultBackend, inner: Any, path: str) -> None:
        self._owner, self._inner, self._path = owner, inner, path

    def write(self, data: bytes | memoryview) -> None:
        self._owner._step("write", self._path)
        self._inner.write(data)

    def close(self, *, sync: bool) -> None:
        try:
            self._owner._step("close", self._path)
        except OSError:
            self._inner.close(sync=False)  # a failed fsync still closes the file
            raise
        self._inner.close(sync=sync)


class StepFaultBackend:
    """Delegates to ``inner``; ``fail_at = k`` makes the k-th mutating step (0-based, counted
    from when it was armed) raise ``OSError(errno_)``; ``steps`` records every step."""

    def __init__(self, inner: Any, *, removes: bool = False) -> None:
        self.inner = inner
        self.removes = removes  # count (and fail) ``remove`` calls too: a gc's steps
        self.root = inner.root
        self.steps: list[Step] = []
        self.fail_at: int | None = None
        self.errno_ = errno.ENOSPC
        self.failed: Step | None = None
        self._lock = threading.Lock()

    def arm(self, fail_at: int | None, errno_: int = errno.ENOSPC) -> None:
        with self._lock:
            self.steps, self.fail_at, self.errno_, self.failed = [], fail_at, errno_, None

    def _step(self, kind: str, path: str) -> None:
        with self._lock:
            index = len(self.steps)
            self.steps.append(Step(kind, path))
            if self.fail_at is not None and index == self.fail_at:
                self.failed = self.steps[-1]
                raise OSError(self.errno_, os.strerror(self.errno_), self.inner.describe(path))

    def makedirs(self, path: str) -> None:
        self._step("makedirs", path)
        self.inner.makedirs(path)

    def open_write(self, path: str) -> _Handle:
        self._step("open_write", path)
        return _Handle(self, self.inner.open_write(path), path)

    def rename(self, src: str, dst: str) -> None:
        self._step("rename", dst)
        self.inner.rename(src, dst)

    def sync_dir(self, path: str) -> None:
        self._step("sync_dir", path)
        self.inner.sync_dir(path)

    def remove(self, path: str) -> None:
        if self.removes:
            self._step("remove", path)
        self.inner.remove(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
