"""Small agreements on the store for calls every rank makes together (a restore): rank 0
tells the others one value, or every rank tells every other one. Keys are numbered by the
caller, each wait is bounded by the timeout: a rank that never comes is an error, not a hang."""

from __future__ import annotations

import json
from typing import Any

from gpusnap.distributed.poll import poll
from gpusnap.errors import CheckpointError

__all__ = ["Exchange"]


class Exchange:
    def __init__(self, store: Any, rank: int, size: int, timeout_s: float) -> None:
        self._store, self.rank, self.size, self.timeout_s = store, rank, size, timeout_s

    def from_root(self, name: str, value: Any = None) -> Any:
        """Rank 0's ``value`` (JSON), on every rank."""
        key = f"{name}/root"
        if self.rank == 0:
            self._store.set(key, json.dumps(value))
            return value
        poll(lambda: bool(self._store.check([key])), self.timeout_s, lambda: self._late(name, [0]))
        return json.loads(self._store.get(key).decode())

    def every(self, name: str, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON), in rank order, on every rank."""
        counter = f"{name}/n"
        self._store.set(f"{name}/{self.rank}", json.dumps(value))
        self._store.add(counter, 1)
        keys = [f"{name}/{r}" for r in range(self.size)]
        poll(lambda: self._store.add(counter, 0) >= self.size, self.timeout_s,
             lambda: self._late(name, [r for r, k in enumerate(keys) if not self._store.check([k])]))
        return [json.loads(v.decode()) for v in self._store.multi_get(keys)]

    def _late(self, name: str, ranks: list[int]) -> CheckpointError:
        return CheckpointError(
            f"rank(s) {', '.join(map(str, ranks))} did not reach {name.split('/')[0]} within "
            f"Config.collective_timeout_s={self.timeout_s:g} s: every rank calls it together"
        )
