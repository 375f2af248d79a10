"""``torch.distributed.checkpoint``: ``save``, ``async_save`` with a ``DefaultStager``, and plain
``async_save`` (no stager of the caller's: DCP's own, which stages synchronously inside the
call into pageable host memory, a fresh copy each save).

Single process, no process group: ``save`` then assumes the local process (``no_dist``), and
``async_save`` needs a process group only when one is initialised (it must then have a CPU
backend). A user-owned ``DefaultStager`` keeps its pinned host copy between saves, so the
first save (pinning the whole state: slow) and warm saves are reported apart.

``async_save`` is used the way torchtitan uses it: a new save first waits for the previous
upload (one checkpoint in flight), and the training step waits for the staging copy before
its first write to checkpointed state (``SaveHandle.before_mutation``), because DCP copies
on its own stream from a background thread while the program runs.

torch 2.11's ``DefaultStager._stage`` ends every stage with ``self._state_dict_stager.close()``
("release reference cycle to prevent memory leaks in async_save"). ``StateDictStager.close``
clears its pinned-copy cache and its deepcopy dispatch table, so a stager cannot stage twice:
the second ``async_save`` deep-copies the dict through ``__reduce_ex__``, meets the class
``dict`` and fails at ``self._deepcopy_dispatch[type]`` with ``KeyError: <class 'type'>``.
torch 2.13 no longer closes in ``_stage`` (``async_save`` closes only a stager it made
itself). The bench gives 2.11 the later behaviour: the per-stage ``close`` of the stager's
``StateDictStager`` is deferred to teardown (``_DeferredClose``), counted, and named in the
row's notes, so the warm saves reuse the pinned copy there as they do on later torch.
"""

from __future__ import annotations

import inspect
import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from gpusnap.bench.system import (
    RestoreResult,
    SaveHandle,
    System,
    blocking_handle,
    sync,
)
from gpusnap.bench.workloads import Workload

__all__ = ["DcpAsyncPlain", "DcpAsyncSave", "DcpSave", "dcp_unavailable"]


def dcp_unavailable() -> str | None:
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return "unavailable: torch.distributed is not built into this torch"
        import torch.distributed.checkpoint  # noqa: F401
    except Exception as exc:  # noqa: BLE001  an optional baseline's import failure is a row, not a crash
        return f"unavailable: {type(exc).__name__}: {exc}"
    return None


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _no_dist_kwargs(fn: Callable[..., Any]) -> dict[str, Any]:
    """``no_dist=True`` where the installed torch accepts it (not every version does)."""
    return {"no_dist": True} if _accepts(fn, "no_dist") else {}


class _DcpBase(System):
    family = "torch.distributed.checkpoint"
    target = "tmpfs"

    def __init__(self, root: str) -> None:
        self.dir = os.path.join(root, self.key)
        self._latest: str | None = None

    def unavailable(self, wl: Workload) -> str | None:
        return dcp_unavailable()

    def setup(self, wl: Workload) -> None:
        os.makedirs(self.dir, exist_ok=True)

    def _path(self, index: int) -> str:
        return os.path.join(self.dir, f"ckpt-{index}")

    def prepare_save(self, wl: Workload, index: int) -> None:
        # Keep only the latest committed checkpoint, as keep_last=1 would.
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if path != self._latest:
                shutil.rmtree(path, ignore_errors=True)

    def restore(self, wl: Workload, target: Workload) -> RestoreResult | None:
        import torch.distributed.checkpoint as dcp

        from gpusnap.bench.measure import timed_step

        if self._latest is None:
            return None
        sync(target.device)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target.tensors(), checkpoint_id=self._latest, **_no_dist_kwargs(dcp.load))
        sync(target.device)
        eager = time.perf_counter() - t0
        return RestoreResult(eager_s=eager, first_step_s=timed_step(target), notes=["dcp.load in place"])

    def verify(self, wl: Workload, target: Workload, index: int, expected: dict[str, Any]) -> tuple[bool, str]:
        """``dcp.load`` of save ``index`` into ``target``'s tensors in place, compared bit for bit."""
        import torch.distributed.checkpoint as dcp

        from gpusnap.bench.verify import compare

        path = self._path(index)
        if not os.path.isdir(path):
            return False, f"save {index} left no checkpoint at {path}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target.tensors(), checkpoint_id=path, **_no_dist_kwargs(dcp.load))
        sync(target.device)
        return compare(expected, target.tensors())

    def bytes_on_disk(self) -> int | None:
        from gpusnap.bench.system import dir_bytes

        return dir_bytes(self._latest) if self._latest else None

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class DcpSave(_DcpBase):
    key = "dcp_save"
    label = "DCP save"

    def save(self, wl: Workload, index: int) -> SaveHandle:
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter()
        path = self._path(index)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp.save(wl.tensors(), checkpoint_id=path, **_no_dist_kwargs(dcp.save))
        self._latest = path
        return blocking_handle(started)


class DcpAsyncSave(_DcpBase):
    key = "dcp_async"
    label = "DCP async_save (DefaultStager)"
    measures_throughput = True

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self._stager: Any = None
        self._upload: Future[Any] | None = None
        self._pinned = 0
        self._options = ""
        self._fallback = False
        self._deferred: _DeferredClose | None = None

    def setup(self, wl: Workload) -> None:
        super().setup(wl)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # The upload thread calls dcp.save, which warns on every call without a process
        # group; a catch_warnings around async_save cannot reach that thread.
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)

        cuda = wl.device.type == "cuda"
        # Without CUDA, DefaultStager refuses pinned memory, async staging and non-blocking
        # copies; it then stages synchronously inside async_save (the CPU smoke test only).
        options = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda, use_non_blocking_copy=cuda
        )
        self._options = repr(options)
        self._stager = DefaultStager(options)
        self._deferred = _DeferredClose.install(self._stager)
        self._pinned = wl.state_bytes() if cuda else 0

    def save(self, wl: Workload, index: int) -> SaveHandle:
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter()
        if self._upload is not None:
            self._upload.result()  # one checkpoint in flight, as torchtitan keeps it
        path = self._path(index)
        kwargs = _no_dist_kwargs(dcp.async_save)
        if _accepts(dcp.async_save, "async_stager"):
            kwargs["async_stager"] = self._stager
        elif not self._fallback:
            self._fallback = True  # a torch without async_stager: DCP's own staging, per save
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            response = dcp.async_save(wl.tensors(), checkpoint_id=path, **kwargs)
        staging, upload = _futures(response)
        self._upload = upload
        self._latest = path
        handle = SaveHandle(
            started=started,
            returned=time.perf_counter(),
            is_captured=staging.done,
            is_durable=upload.done,
            wait=lambda: _result(upload),
            before_mutation=lambda: _result(staging),
        )

        def captured(_: Future[Any]) -> None:
            if handle.captured_at is None:
                handle.captured_at = time.perf_counter()

        def durable(_: Future[Any]) -> None:
            if handle.durable_at is None:
                handle.durable_at = time.perf_counter()

        staging.add_done_callback(captured)
        upload.add_done_callback(durable)
        return handle

    def pinned_bytes(self) -> int | None:
        return self._pinned  # cudaHostRegister'd staging copy: torch's host allocator stats miss it

    def notes(self) -> list[str]:
        if self._fallback:
            return ["this torch's async_save takes no async_stager: its built-in staging was used"]
        out = [f"DefaultStager({self._options})"] if self._options else []
        if self._deferred is not None and self._deferred.calls:
            out.append(
                f"this torch's DefaultStager closed its StateDictStager after each stage ({self._deferred.calls} "
                "times; a reused stager then fails with KeyError: <class 'type'>): the bench deferred that close "
                "to teardown, as torch 2.13 does, so warm saves reuse the staged host copy (pinned on CUDA)"
            )
        return out

    def teardown(self) -> None:
        try:
            if self._upload is not None:
                try:
                    self._upload.result()
                finally:
                    self._upload = None
        finally:
            if self._deferred is not None:
                self._deferred.uninstall()  # DefaultStager.close below now really closes it
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            super().teardown()


class DcpAsyncPlain(DcpAsyncSave):
    """``async_save(state, checkpoint_id=...)`` as its docstring shows it: no stager passed."""

    key = "dcp_async_plain"
    label = "DCP async_save (plain)"

    def setup(self, wl: Workload) -> None:
        _DcpBase.setup(self, wl)
        # (the upload thread's dcp.save warns on every call without a process group)
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)
        self._stager = None  # async_stager=None: DCP makes, uses and closes its own per save

    def pinned_bytes(self) -> int | None:
        return 0

    def notes(self) -> list[str]:
        return ["async_save without async_stager: DCP's DefaultStager(no pinned memory, synchronous staging)"]


class _DeferredClose:
    """Turns ``close()`` of a ``DefaultStager``'s ``StateDictStager`` into a counted no-op until
    :meth:`uninstall`. torch 2.11 calls it at the end of every ``DefaultStager._stage``, which
    drops the pinned cache and empties the deepcopy dispatch table (the next stage then fails
    with ``KeyError: <class 'type'>``); torch 2.13 never calls it there, and ``calls`` stays 0.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    @classmethod
    def install(cls, stager: Any) -> _DeferredClose | None:
        inner = getattr(stager, "_state_dict_stager", None)  # private: absent on some torch
        if inner is None or not callable(getattr(inner, "close", None)):
            return None
        deferred = cls(inner)
        inner.close = deferred._close  # an instance attribute, shadowing the class's method
        return deferred

    def _close(self) -> None:
        self.calls += 1  # from the stager's staging thread or the caller's: an int under the GIL

    def uninstall(self) -> None:
        vars(self.inner).pop("close", None)


def _futures(response: Any) -> tuple[Future[Any], Future[Any]]:
    """(staging, upload) futures from either return type of ``async_save``."""
    if hasattr(response, "staging_completion"):
        return response.staging_completion, response.upload_completion
    done: Future[Any] = Future()
    done.set_result(None)  # older API: staging finished inside the call
    return done, response


def _result(future: Future[Any]) -> dict[str, Any]:
    future.result()
    return {}
