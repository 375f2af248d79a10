"""A direct-copy helper *process*: copies runs of pack files straight from the page cache into
the restore's landing slots on the device, with no copy through the host's CPU.

Standard library only (libcudart through ctypes), run with ``python -I -S``. Per request it
maps each pack read-only, page-locks the pages the runs cover *in place*
(``cudaHostRegister``, read-only), copies each run host-to-device into the landing buffer
the restoring process shares over CUDA IPC, waits for the copies, unlocks and unmaps. One
process page-locks at 10-20 GB/s and threads of one process do not page-lock in parallel,
but processes do: 8 of them moved a 4 GB file to the device at 48 GB/s, against
25 GB/s for reader processes copying into pinned memory (BENCHMARKS.md).

Backends: ``cuda`` (above); ``memfd`` (tests, and hosts without CUDA): the landing buffer is
a shared memory file the parent passes, and the copy is a ``memmove`` from the same read-only
map, so everything but the CUDA calls runs in CI.

Usage: ``python -I -S direct_worker.py``; the first message on stdin is the job (a dict:
``backend``, then ``lib``, ``device``, ``handle`` (hex), ``offset`` for ``cuda``, or ``fd``,
``nbytes`` for ``memfd``). Replies ``("ready", page size, [IPC event handles, hex])`` or
``("failed", why)``; then per request, a list of runs ``(path, file offset, length, landing
offset)``, replies ``("ok", [bytes each run got], event)`` once the copies are *queued*:
the landing slot holds the bytes once event number ``event`` has completed (-1: already;
a run past the end of its file got fewer, and then nothing was copied), ``("error", errno, strerror, path)``, or ``("cuda", what)`` after a CUDA error
(the parent then stops using this process). Protocol framing: ``reader_procs.py``.
"""

from __future__ import annotations

import ctypes
import marshal
import mmap
import os
import select
import signal
import struct
import sys

LEN = struct.Struct("<Q")
PAGE = mmap.PAGESIZE
H2D = 1  # cudaMemcpyHostToDevice
REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: a read-only map cannot be page-locked without it
EVENTS = 4  # interprocess events per helper, recorded in turn


class CudaError(RuntimeError):
    pass


def send(out, obj) -> None:  # type: ignore[no-untyped-def]
    body = marshal.dumps(obj)
    out.write(LEN.pack(len(body)) + body)
    out.flush()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaBackend:
    """Page-lock in place, copy to the device over IPC, wait."""

    def __init__(self, job: dict) -> None:  # type: ignore[type-arg]
        lib = self.lib = ctypes.CDLL(job["lib"])
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cudaHostRegister.argtypes = [vp, sz, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [vp]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(vp), IpcHandle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [vp]
        lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        lib.cudaStreamSynchronize.argtypes = [vp]
        self.check(lib.cudaSetDevice(job["device"]), "cudaSetDevice")
        self.check(lib.cudaFree(None), "cudaFree")  # (creates the context now)
        # This process launches no kernel: give back what a context reserves for them (per-thread
        # stacks for every resident thread, the device malloc heap, the printf buffer; hundreds of MiB).
        for limit in (0, 1, 2):  # cudaLimitStackSize, cudaLimitPrintfFifoSize, cudaLimitMallocHeapSize
            lib.cudaDeviceSetLimit(limit, ctypes.c_size_t(0))
        lib.cudaGetLastError()  # (a limit the driver refuses is not an error for us)
        handle = IpcHandle()
        ctypes.memmove(ctypes.byref(handle), bytes.fromhex(job["handle"]), 64)
        base = vp()
        self.check(lib.cudaIpcOpenMemHandle(ctypes.byref(base), handle, 1), "cudaIpcOpenMemHandle")  # 1: lazy peer access
        self.base = base
        self.landing = (base.value or 0) + job["offset"]
        self.stream = vp()
        self.check(lib.cudaStreamCreateWithFlags(ctypes.byref(self.stream), 1), "cudaStreamCreateWithFlags")  # non-blocking
        lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        lib.cudaEventRecord.argtypes = [vp, vp]
        lib.cudaEventSynchronize.argtypes = [vp]
        lib.cudaIpcGetEventHandle.argtypes = [ctypes.c_void_p, vp]
        # events the parent opens once (cudaIpcOpenEventHandle) and waits for on its stream;
        # used in turn (a wait queued before a later record still waits for the earlier one)
        self.events = []
        self.handles = []
        for _ in range(EVENTS):
            ev = vp()
            self.check(lib.cudaEventCreateWithFlags(ctypes.byref(ev), 0x2 | 0x4), "cudaEventCreate")  # no timing, interprocess
            h = (ctypes.c_char * 64)()
            self.check(lib.cudaIpcGetEventHandle(h, ev), "cudaIpcGetEventHandle")
            self.events.append(ev)
            self.handles.append(bytes(h).hex())
        self.turn = 0

    def check(self, err: int, what: str) -> None:
        if err:
            self.lib.cudaGetLastError()  # (clear it: a later call must not report it again)
            raise CudaError(f"{what} failed: CUDA error {err}")

    def lock(self, addr: int, n: int) -> None:
        self.check(self.lib.cudaHostRegister(addr, n, REGISTER_READ_ONLY), "cudaHostRegister")

    def unlock(self, addr: int) -> None:
        self.lib.cudaHostUnregister(addr)

    def copy(self, at: int, addr: int, n: int) -> None:
        self.check(self.lib.cudaMemcpyAsync(self.landing + at, addr, n, H2D, self.stream), "cudaMemcpyAsync")

    def wait(self) -> None:
        self.check(self.lib.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def wait_event(self, i: int) -> None:
        self.check(self.lib.cudaEventSynchronize(self.events[i]), "cudaEventSynchronize")

    def record(self) -> int:
        """Record the next event after the copies queued so far: its index."""
        i, self.turn = self.turn, (self.turn + 1) % len(self.events)
        self.check(self.lib.cudaEventRecord(self.events[i], self.stream), "cudaEventRecord")
        return i

    def event_handles(self) -> list[str]:
        return self.handles


class MemfdBackend:
    """The landing buffer is a shared memory file; copies are ``memmove``. Counts the page
    ranges locked, so tests can see them."""

    def __init__(self, job: dict) -> None:  # type: ignore[type-arg]
        self.nbytes = job["nbytes"]
        addr = _libc.mmap(None, self.nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, job["fd"], 0)
        os.close(job["fd"])
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of the landing buffer failed")
        self.landing = addr
        self.locked: set[int] = set()

    def lock(self, addr: int, n: int) -> None:
        if addr % PAGE or n % PAGE or addr in self.locked:  # what cudaHostRegister would refuse
            raise CudaError(f"lock of {n} bytes at {addr:#x}: not whole pages, or locked twice")
        self.locked.add(addr)

    def unlock(self, addr: int) -> None:
        self.locked.discard(addr)

    def copy(self, at: int, addr: int, n: int) -> None:
        if at < 0 or at + n > self.nbytes:
            raise CudaError(f"a copy of {n} bytes at {at} is outside the landing buffer")
        ctypes.memmove(self.landing + at, addr, n)

    def wait(self) -> None:
        pass

    def wait_event(self, i: int) -> None:
        pass

    def record(self) -> int:
        return -1  # (memmove: done on return)

    def event_handles(self) -> list[str]:
        return []


def page_spans(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole pages ``(start, end)`` that runs ``(offset, length)`` of one file cover,
    overlapping or touching ones merged (a page may be locked only once)."""
    spans: list[tuple[int, int]] = []
    for off, n in sorted(runs):
        lo, hi = off // PAGE * PAGE, -(-(off + n) // PAGE) * PAGE
        if spans and lo <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
        else:
            spans.append((lo, hi))
    return spans


class Batch:
    """One request's files, maps and locked pages, from :meth:`issue` (copies queued) to
    :meth:`finish` (copies done, pages unlocked, maps and files closed)."""

    def __init__(self, backend) -> None:  # type: ignore[no-untyped-def]
        self.backend = backend
        self.files: dict[str, tuple[int, int]] = {}  # path -> (fd, size)
        self.maps: list[tuple[int, int]] = []  # (address, length) to unmap
        self.locked: list[int] = []
        self.event = -1  # the backend's event after this batch's copies (-1: none)

    def issue(self, runs) -> list[int]:  # type: ignore[no-untyped-def]
        """Queue every run's copy, or none when one is past the end of its file: the bytes
        each run can get. Raises OSError (with the path) or CudaError; finish() either way."""
        got: list[int] = []
        for path, offset, length, _ in runs:
            if path not in self.files:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    self.files[path] = (fd, os.fstat(fd).st_size)
                except OSError as exc:
                    raise OSError(exc.errno, exc.strerror, path) from None
            size = self.files[path][1]
            got.append(max(0, min(length, size - offset)))
        if any(g != r[2] for g, r in zip(got, runs)):
            return got  # truncated: the parent reads it again itself, and names the chunk
        by_path: dict[str, list[tuple[int, int, int]]] = {}
        for path, offset, length, at in runs:
            by_path.setdefault(path, []).append((offset, length, at))
        for path, items in by_path.items():
            fd, size = self.files[path]
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), path)
            self.maps.append((addr, size))
            for lo, hi in page_spans([(o, n) for o, n, _ in items]):
                hi = min(hi, -(-size // PAGE) * PAGE)  # (the map ends at the file's last page)
                self.backend.lock(addr + lo, hi - lo)
                self.locked.append(addr + lo)
            for offset, length, at in items:
                self.backend.copy(at, addr + offset, length)
        self.event = self.backend.record()
        return got

    def finish(self) -> None:
        """Wait for the copies (never unlock pages a copy may still read), then release all."""
        try:
            if self.event >= 0:
                self.backend.wait_event(self.event)  # (not the stream: a later batch may be queued)
            else:
                self.backend.wait()
        except CudaError:
            pass  # (reported by the request that failed)
        finally:
            for a in self.locked:
                self.backend.unlock(a)
            for a, n in self.maps:
                _libc.munmap(a, n)
            for fd, _ in self.files.values():
                os.close(fd)
            self.locked, self.maps, self.files = [], [], {}


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the program (reader_worker.py)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    head = inp.read(LEN.size)
    if len(head) != LEN.size:
        return
    job = marshal.loads(inp.read(LEN.unpack(head)[0]))
    try:
        backend = CudaBackend(job) if job["backend"] == "cuda" else MemfdBackend(job)
    except (OSError, CudaError, KeyError, AttributeError) as exc:
        send(out, ("failed", f"{type(exc).__name__}: {exc}"))
        return
    send(out, ("ready", PAGE, backend.event_handles()))
    # The reply goes out once the copies are *queued*, with the event the parent's stream
    # waits for: this process then locks the next batch's pages while the copy engine still
    # runs this one (one process alternating lock, copy and wait moved only ~20 GB/s with 8).
    # A batch's pages are unlocked once a later batch is queued, or when no request waits.
    pending: list[Batch] = []
    fd = inp.fileno()
    while True:
        if pending and not select.select([fd], [], [], 0)[0]:
            for b in pending:
                b.finish()
            pending = []
        head = inp.read(LEN.size)
        if len(head) != LEN.size:
            break
        runs = marshal.loads(inp.read(LEN.unpack(head)[0]))
        batch = Batch(backend)
        try:
            got = batch.issue(runs)
        except OSError as exc:
            batch.finish()
            send(out, ("error", exc.errno or 0, exc.strerror or str(exc), exc.filename or ""))
            continue
        except CudaError as exc:
            batch.finish()
            send(out, ("cuda", str(exc)))
            break  # (its context may be unusable: the parent stops using this process)
        if batch.event < 0:
            batch.finish()  # (nothing was queued, or the backend copies synchronously)
        send(out, ("ok", got, batch.event))
        for b in pending:
            b.finish()  # (older than the batch just queued: done or nearly)
        pending = [batch] if batch.event >= 0 else []
    for b in pending:
        b.finish()


if __name__ == "__main__":
    main()
