"""The CUDA driver's process checkpoint API, driven from the bench on a child process.

``cuCheckpointProcessLock`` / ``Checkpoint`` / ``Restore`` / ``Unlock`` act on *another*
process (by pid): the driver stops its CUDA work, moves its whole device memory to host
memory it manages, and back. So the bench spawns a child that allocates the same tensor
sizes as the workload's state (random bytes), and the parent calls the API on the child's
pid through ``cuda.bindings.driver`` (cuda-python). The child is idle while the API runs;
the time from lock to unlock is how long a process checkpointed this way cannot run.

Call signatures, as cuda-python binds them (each returns a tuple whose first item is a
``CUresult``): ``cuCheckpointProcessLock(pid, CUcheckpointLockArgs)``,
``cuCheckpointProcessCheckpoint(pid, None)``, ``cuCheckpointProcessRestore(pid, None)``,
``cuCheckpointProcessUnlock(pid, None)``, ``cuCheckpointProcessGetState(pid) -> state``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["ChildHolder", "DriverApi", "DriverError", "cycle", "load_driver"]

_API = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


class DriverError(RuntimeError):
    """A driver call returned an error; the message names the call and the CUresult."""


def load_driver() -> tuple[Any, str | None]:
    """(the ``cuda.bindings.driver`` module, None) or (None, why it cannot be used)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:  # cuda-python before 12.6 named the module cuda.cuda
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError:
            return None, "cuda-python (cuda.bindings.driver) is not installed"
    missing = [name for name in _API if not hasattr(driver, name)]
    if missing:
        return None, f"cuda.bindings.driver has no {', '.join(missing)} (needs cuda-python >= 12.8)"
    return driver, None


class DriverApi:
    def __init__(self, driver: Any) -> None:
        self.d = driver
        self._check("cuInit", driver.cuInit(0))

    def _check(self, call: str, result: Any) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.d.CUresult.CUDA_SUCCESS:
            raise DriverError(f"{call}: {self._name(err)}")
        return values[0] if values else None

    def _name(self, err: Any) -> str:
        try:
            code, name = self.d.cuGetErrorName(err)
        except Exception:  # noqa: BLE001  naming the error must not replace it with another
            return str(err)
        if code != self.d.CUresult.CUDA_SUCCESS:
            return str(err)
        return name.decode() if isinstance(name, bytes) else str(name)

    def version(self) -> int:
        return int(self._check("cuDriverGetVersion", self.d.cuDriverGetVersion()))

    def state(self, pid: int) -> str:
        value = self._check("cuCheckpointProcessGetState", self.d.cuCheckpointProcessGetState(pid))
        return str(getattr(value, "name", value))

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = self.d.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        self._check("cuCheckpointProcessLock", self.d.cuCheckpointProcessLock(pid, args))

    def checkpoint(self, pid: int) -> None:
        self._check("cuCheckpointProcessCheckpoint", self.d.cuCheckpointProcessCheckpoint(pid, None))

    def restore(self, pid: int) -> None:
        self._check("cuCheckpointProcessRestore", self.d.cuCheckpointProcessRestore(pid, None))

    def unlock(self, pid: int) -> None:
        self._check("cuCheckpointProcessUnlock", self.d.cuCheckpointProcessUnlock(pid, None))


def cycle(api: DriverApi, pid: int, *, timeout_ms: int = 30_000) -> dict[str, float]:
    """Lock, checkpoint, restore, unlock ``pid``; seconds per call. The child is left running
    whatever fails (a half-done cycle is rolled forward to unlocked)."""
    times: dict[str, float] = {}
    locked = False
    try:
        t = time.perf_counter()
        api.lock(pid, timeout_ms)
        locked = True
        times["lock_s"] = time.perf_counter() - t
        for name, call in (("checkpoint_s", api.checkpoint), ("restore_s", api.restore), ("unlock_s", api.unlock)):
            t = time.perf_counter()
            call(pid)
            times[name] = time.perf_counter() - t
        locked = False
    finally:
        if locked:
            _recover(api, pid)
    return times


def _recover(api: DriverApi, pid: int) -> None:
    for _ in range(3):
        try:
            state = api.state(pid)
            if "CHECKPOINTED" in state:
                api.restore(pid)
            elif "LOCKED" in state:
                api.unlock(pid)
            else:
                return
        except DriverError:
            return


def _checksum(tensors: list[Any]) -> int:
    # int64 sums wrap modulo 2**64, which is associative: the same bytes give the same sum
    # whatever order the reduction runs in.
    return sum(int(t.sum()) for t in tensors) % (1 << 64)


def _child_main(conn: Connection, sizes: list[int], device_index: int) -> None:
    """Holds ``sizes`` bytes on the GPU (random) until told to exit; answers checksums."""
    import torch

    torch.cuda.set_device(device_index)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    tensors = [torch.empty(max(1, -(-n // 8)), dtype=torch.int64, device="cuda").random_(generator=gen) for n in sizes]
    torch.cuda.synchronize()
    conn.send(("ready", os.getpid(), _checksum(tensors), torch.cuda.memory_allocated()))
    while True:
        msg = conn.recv()
        if msg == "checksum":
            conn.send(_checksum(tensors))
        elif msg == "exit":
            return


class ChildHolder:
    """A spawned child process holding device memory of the given sizes."""

    def __init__(self, sizes: list[int], device_index: int, *, timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")  # a forked child cannot use CUDA after the parent did
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child, sizes, device_index), daemon=True,
                                name="gpusnap-bench-cuda-child")
        self.proc.start()
        child.close()
        if not self._conn.poll(timeout_s):
            self.close()
            raise TimeoutError(f"the CUDA child did not get ready within {timeout_s:.0f} s")
        _, self.pid, self.checksum, self.device_bytes = self._conn.recv()

    def current_checksum(self, timeout_s: float = 600.0) -> int:
        self._conn.send("checksum")
        if not self._conn.poll(timeout_s):
            raise TimeoutError("the CUDA child did not answer")
        return int(self._conn.recv())

    def close(self) -> None:
        try:
            self._conn.send("exit")
        except (OSError, ValueError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self._conn.close()
