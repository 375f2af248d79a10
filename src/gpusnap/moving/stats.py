"""What a suspend and its resume did: :class:`SuspendStats`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SuspendStats"]


@dataclass(frozen=True)
class SuspendStats:
    """Sizes in bytes, times in seconds. A new one is made at each change (``Suspended.stats``).

    Example::

        s = gpusnap.suspend(app_state)
        print(s.stats.bytes, s.stats.device_freed_bytes, s.stats.suspend_s)
        s.resume()
        print(s.stats.resume_s, s.stats.resume_gbps)
    """

    bytes: int  # of the storages moved to host memory (each storage once)
    storages: int
    tensors: int  # tensor objects found on those storages (views and tied weights count each)
    suspend_s: float  # suspend() from call to return
    host_alloc_s: float  # part of suspend_s spent allocating and page-locking host memory (0.0: reused)
    host_reused: bool  # the host memory kept from an earlier suspend served (no page-locking paid)
    pinned: bool  # the host copy is page-locked (CUDA)
    # CUDA: device memory the driver reports freed by the suspend (cudaMemGetInfo after minus
    # before; it includes cache the allocator held before and is blurred by other processes).
    # CPU: the bytes of the storages freed.
    device_freed_bytes: int
    allocator_released_bytes: int  # CUDA: torch.cuda.memory_reserved() before minus after (CPU: 0)
    resumed_bytes: int = 0  # brought back to the device so far
    dropped_bytes: int = 0  # of storages no tensor used any more at resume: not brought back
    changed: tuple[str, ...] = ()  # key paths of storages the program gave other memory meanwhile: left as they are
    resume_s: float | None = None  # resume() until every byte is back (lazy: the last copy done); None: not yet
    resume_return_s: float | None = None  # how long resume() held the caller
    lazy: bool | None = None  # how the (last) resume ran; None: not resumed
    waits: int = 0  # lazy: ops that waited for a storage still on its way

    @property
    def resume_gbps(self) -> float | None:
        """Bytes brought back per second of ``resume_s`` (10**9 bytes per second)."""
        if not self.resume_s or not self.resumed_bytes:
            return None
        return self.resumed_bytes / self.resume_s / 1e9
