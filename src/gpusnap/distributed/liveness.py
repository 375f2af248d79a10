"""Whether a rank that took part is still there, so a survivor does not wait out the whole
timeout for a rank that died: each rank holds its own root's writer lease from its first
save to ``close()``, and on a local root that is a ``flock`` the kernel drops when the
process dies (SIGKILL included). A rank announces in the store once it holds it
(``alive/<rank>``); only those are probed (a probe takes a free lock for an instant, which
would refuse a rank just about to claim it). Object stores cannot tell: only the timeout."""

from __future__ import annotations

from typing import Any

from gpusnap.storage.backend import LocalBackend, open_backend
from gpusnap.storage.ranks import rank_root

__all__ = ["Liveness", "alive_key"]


def alive_key(rank: int) -> str:
    return f"alive/{rank}"


class Liveness:
    def __init__(self, root: str, store: Any) -> None:
        self._root = root
        self._store = store
        self._announced: set[int] = set()

    def announce(self, rank: int) -> None:
        """This rank holds its root's lease now (once per Checkpointer)."""
        if rank not in self._announced:
            self._store.set(alive_key(rank), b"1")
            self._announced.add(rank)

    def gone(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that announced themselves and no longer hold their lease."""
        out = []
        for rank in ranks:
            backend = open_backend(rank_root(self._root, rank))
            if not isinstance(backend, LocalBackend) or not self._store.check([alive_key(rank)]):
                continue
            if not backend.writer_held():
                out.append(rank)
        return out
