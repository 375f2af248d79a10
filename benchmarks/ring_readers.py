"""Restore probe for issue 5: reader *processes* fill a shared, page-locked ring while one
thread copies each filled slot to the device.

Why: the restore runs at 17.7-19 GB/s (32-34% of host-to-device) because its copy thread and
its reader threads share one GIL (`BENCHMARKS.md`, seventh and eighth sessions), while the
host can read a tmpfs file into pinned memory at 27 GB/s with 8 threads and 42 GB/s with 16.
Readers in their own processes (`ring_reader_worker.py`, standard library only) take no GIL
from the copy thread. The ring is a shared memory file (``memfd_create``) that every reader
maps and the parent page-locks once (``cudaHostRegister``), so each copy to the device is a
plain pinned copy. This probe measures that design alone, before it goes into the loader:
end-to-end GB/s against the reader count, and what starting the readers and page-locking the
ring cost.

Run on a GPU machine: ``PYTHONPATH=src python3 benchmarks/ring_readers.py [--file-gb 4]``.
On the CPU the same pipeline copies into a CPU tensor (the tests check the bytes).
"""

from __future__ import annotations

import argparse
import collections
import mmap
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

MiB = 1 << 20
WORKER = str(Path(__file__).with_name("ring_reader_worker.py"))
CMD_BYTES, DONE_BYTES = 24, 8
READ_TIMEOUT_S = 60.0  # no piece read for this long: a reader died (the probe fails, not hangs)


def cudart() -> Any:
    """libcudart as loaded by torch, through ctypes (its calls release the GIL)."""
    import ctypes

    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcudart" in line})
    lib = ctypes.CDLL(paths[0])
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    return lib


class Ring:
    """``slots`` x ``part`` bytes of shared memory: mapped here, page-locked on CUDA."""

    def __init__(self, slots: int, part: int, lock: bool, where: str | None = None) -> None:
        """``where``: a directory (a tmpfs, e.g. one mounted with ``huge=always``) for the
        ring's file, unlinked at once; default an anonymous ``memfd``."""
        self.part, self.nbytes = part, slots * part
        started = time.perf_counter()  # (lock_s: allocating the pages and page-locking them)
        if where is None:
            self.fd = os.memfd_create("gpusnap-ring")
        else:
            name = tempfile.mktemp(prefix="gpusnap-ring-", dir=where)
            self.fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.unlink(name)
        os.ftruncate(self.fd, self.nbytes)
        self.map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array)
        self.lib: Any = None
        if lock:
            self.lib = cudart()
            err = self.lib.cudaHostRegister(self.array.ctypes.data, self.nbytes, 0)
            if err:
                raise RuntimeError(f"cudaHostRegister of the ring failed: error {err}")
        self.lock_s = time.perf_counter() - started

    def close(self) -> None:
        if self.lib is not None:
            self.lib.cudaHostUnregister(self.array.ctypes.data)
        del self.tensor, self.array
        self.map.close()
        os.close(self.fd)


def ring_restore(path: str, dev: torch.device, procs: int, part: int = 64 * MiB, slots: int = 16,
                 copy_slot: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
                 dst: torch.Tensor | None = None, end: int | None = None,
                 on_start: Callable[[], None] | None = None, ring_dir: str | None = None) -> dict[str, Any]:
    """Copy the file at ``path`` to a new uint8 tensor on ``dev`` through ``procs`` reader
    processes and a ring of ``slots`` x ``part`` bytes; timings and the tensor. With ``dst``
    and ``end``, only the file's first ``end`` bytes, into ``dst``; ``on_start()`` runs when
    the clock starts (``t0`` in the result). ``ring_dir``: see ``Ring``.

    ``copy_slot(dst, src)`` queues one copy out of the ring and returns an event (``query()``,
    ``synchronize()``) after which ``src`` may be read into again, or None when the copy is
    done on return. Default: on CUDA, a copy on a side stream and its event; else a copy now.
    The clock starts once every reader has started (``spawn_s`` is their start-up)."""
    size = os.path.getsize(path)
    cuda = dev.type == "cuda"
    ring = Ring(slots, part, lock=cuda, where=ring_dir)
    pinned = cuda and ring.tensor.is_pinned()  # page-locked, as torch sees it: copies run async
    stream = torch.cuda.Stream(dev) if cuda else None
    if copy_slot is None:
        copy_slot = _stream_copy(stream) if stream is not None else _copy_now
    workers: list[subprocess.Popen[bytes]] = []
    collectors: list[threading.Thread] = []
    copying: collections.deque[tuple[Any, int]] = collections.deque()  # (event, ring offset)
    try:
        started = time.perf_counter()
        workers = [subprocess.Popen([sys.executable, WORKER, path, str(ring.fd), str(ring.nbytes)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(ring.fd,))
                   for _ in range(procs)]
        for w in workers:  # each says it is ready (file open, ring mapped)
            if len(w.stdout.read(DONE_BYTES)) != DONE_BYTES:
                raise RuntimeError(f"a reader failed to start: exit code {w.wait(timeout=30)}")
        spawn_s = time.perf_counter() - started
        ready: queue.SimpleQueue[int] = queue.SimpleQueue()

        def collect(out: Any) -> None:  # one thread per reader: blocking reads release the GIL
            while len(raw := out.read(DONE_BYTES)) == DONE_BYTES:
                ready.put(int.from_bytes(raw, "little"))

        collectors = [threading.Thread(target=collect, args=(w.stdout,), daemon=True) for w in workers]
        for c in collectors:
            c.start()
        if dst is None:
            dst = torch.empty(size, dtype=torch.uint8, device=dev)
        end = size if end is None else end
        pieces = [(off, min(part, end - off)) for off in range(0, end, part)]
        reading: dict[int, tuple[int, int]] = {}  # ring offset -> (file offset, length)
        issued = turn = 0

        def read_into(at: int) -> None:
            nonlocal issued, turn
            off, n = pieces[issued]
            issued += 1
            reading[at] = (off, n)
            w = workers[turn % procs]
            turn += 1
            try:
                w.stdin.write(at.to_bytes(8, "little") + off.to_bytes(8, "little") + n.to_bytes(8, "little"))
                w.stdin.flush()
            except BrokenPipeError:
                w.wait(timeout=30)
                raise RuntimeError(f"a reader died: reader exit codes {[r.poll() for r in workers]}") from None

        if cuda:
            torch.cuda.synchronize(dev)
        started = time.perf_counter()
        if on_start is not None:
            on_start()
        for k in range(min(slots, len(pieces))):
            read_into(k * part)
        for _ in range(len(pieces)):
            try:
                at = ready.get(timeout=READ_TIMEOUT_S)
            except queue.Empty:
                codes = [w.poll() for w in workers]
                raise RuntimeError(f"no piece read for {READ_TIMEOUT_S} s; reader exit codes {codes}") from None
            off, n = reading.pop(at)
            copying.append((copy_slot(dst[off : off + n], ring.tensor[at : at + n]), at))
            # a slot is read into again once its copy is done (in order, oldest first)
            while copying and issued < len(pieces) and (copying[0][0] is None or copying[0][0].query()):
                read_into(copying.popleft()[1])
            if not reading and copying and issued < len(pieces):  # every slot waits on a copy
                event, at = copying.popleft()
                event.synchronize()
                read_into(at)
        _drain(copying)
        total_s = time.perf_counter() - started
    finally:
        _drain(copying)  # no copy may still read the ring when it is unmapped
        if stream is not None:
            stream.synchronize()
        for w in workers:
            try:
                w.stdin.close()
            except BrokenPipeError:  # (a reader that died)
                pass
        for w in workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        for c in collectors:
            c.join(timeout=30)
        ring.close()
    return {"GBps": end / total_s / 1e9, "s": total_s, "t0": started, "spawn_s": spawn_s, "lock_s": ring.lock_s,
            "procs": procs, "part_MiB": part // MiB, "slots": slots, "pinned": pinned,
            "exit_codes": [w.returncode for w in workers], "dst": dst}


def register_copy(path: str, dst: torch.Tensor, start: int, end: int, part: int) -> dict[str, float]:
    """Copy the file's bytes [start, end) to ``dst[start:end]`` with no host copy at all:
    page-lock each ``part`` of a read-only map of the file in place (``cudaHostRegister``,
    read-only flag), copy it, unlock it once its copy is done. The driver registers one part
    at a time (eighth session), so this is one thread; it runs beside the reader processes."""
    lib = cudart()
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, end, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8)
    addr = arr.ctypes.data
    src = torch.from_numpy(arr)  # (read-only: torch warns; it is only read)
    stream = torch.cuda.Stream(dst.device)
    copying: collections.deque[tuple[Any, int, int]] = collections.deque()
    reg_s = 0.0
    try:
        for off in range(start, end, part):
            n = min(part, end - off)
            t = time.perf_counter()
            err = lib.cudaHostRegister(addr + off, n, 8)  # 8: cudaHostRegisterReadOnly
            reg_s += time.perf_counter() - t
            if err:
                raise RuntimeError(f"cudaHostRegister of the file map failed: error {err}")
            with torch.cuda.stream(stream):
                dst[off : off + n].copy_(src[off : off + n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            copying.append((event, off, n))
            while copying and copying[0][0].query():
                lib.cudaHostUnregister(addr + copying.popleft()[1])
    finally:
        stream.synchronize()
        for _, off, _ in copying:
            lib.cudaHostUnregister(addr + off)
        del src, arr
        mm.close()
    return {"end_t": time.perf_counter(), "reg_GBps": (end - start) / reg_s / 1e9 if reg_s else 0.0}


def hybrid_restore(path: str, dev: torch.device, procs: int, part: int, share: float,
                   reg_part: int = 64 * MiB, ring_dir: str | None = None) -> dict[str, Any]:
    """The file's tail ``share`` goes to the device page-locked in place (``register_copy``,
    one thread), the rest through the reader processes' ring, both at once."""
    size = os.path.getsize(path)
    split = int(size * (1 - share)) // reg_part * reg_part
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    out: dict[str, Any] = {}

    def tail() -> None:
        try:
            out.update(register_copy(path, dst, split, size, reg_part))
        except BaseException as exc:  # (re-raised below)
            out["error"] = exc

    th = threading.Thread(target=tail, daemon=True)
    r = ring_restore(path, dev, procs, part, dst=dst, end=split, on_start=th.start, ring_dir=ring_dir)
    th.join()
    if "error" in out:
        raise out["error"]
    ring_end = r["t0"] + r["s"]
    total = max(ring_end, out["end_t"]) - r["t0"]
    r.update(GBps=size / total / 1e9, s=total, ring_s=r["s"], reg_s=out["end_t"] - r["t0"],
             reg_GBps=out["reg_GBps"], share=share)
    return r


def _stream_copy(stream: Any) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    def copy(dst: torch.Tensor, src: torch.Tensor) -> Any:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    return copy


def _copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _drain(copying: collections.deque[tuple[Any, int]]) -> None:
    while copying:
        event, _ = copying.popleft()
        if event is not None:
            event.synchronize()


def spot_check(path: str, dst: torch.Tensor, samples: int = 1 << 16) -> bool:
    """``samples`` random bytes of ``dst`` equal the file's."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    idx = np.random.default_rng(0).integers(0, len(data), samples)
    got = dst[torch.from_numpy(idx).to(dst.device)].cpu().numpy()
    return bool(np.array_equal(got, data[idx]))


def probe_file(gb: float, where: str | None) -> tuple[str, int]:
    """A file of ~``gb`` GB of random bytes (whole 64 MiB blocks) in a new directory under
    ``where`` (default /dev/shm): its path and size."""
    size = int(gb * 1e9) // (64 * MiB) * (64 * MiB)
    tmp = tempfile.mkdtemp(dir=where or ("/dev/shm" if os.path.isdir("/dev/shm") else None))
    path = os.path.join(tmp, "data")
    with open(path, "wb") as f:
        block = os.urandom(64 * MiB)
        for _ in range(size // len(block)):
            f.write(block)
    return path, size


def remove_probe_file(path: str) -> None:
    os.unlink(path)
    os.rmdir(os.path.dirname(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--file-gb", type=float, default=4.0)
    ap.add_argument("--dir", default=None, help="where the file goes (default /dev/shm)")
    ap.add_argument("--ring-dir", default=None,
                    help="where the ring's file goes (default: an anonymous memfd), e.g. a huge-page tmpfs")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each variant (each line is one)")
    ap.add_argument("--variants", default="4x64,8x64,12x64,8x32,8x128,8x64z30,12x64z30,12x64z45",
                    help="reader processes x piece MiB, comma-separated; zNN: NN%% of the file "
                         "page-locked in place and copied beside the ring (CUDA only)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path, size = probe_file(args.file_gb, args.dir)
    rows = []
    try:
        ring_restore(path, dev, 2, 64 * MiB)  # warm: page cache, CUDA context, copy paths
        for variant in args.variants.split(",") * args.repeat:
            shape, _, share = variant.partition("z")
            procs, part = (int(v) for v in shape.split("x"))
            if share:
                r = hybrid_restore(path, dev, procs, part * MiB, int(share) / 100, ring_dir=args.ring_dir)
            else:
                r = ring_restore(path, dev, procs, part * MiB, ring_dir=args.ring_dir)
            ok = spot_check(path, r.pop("dst"))
            extra = (f" [zero-copy {share}%: ring {r['ring_s'] * 1e3:.0f} ms, registered part "
                     f"{r['reg_s'] * 1e3:.0f} ms, registering {r['reg_GBps']:.1f} GB/s]" if share else "")
            line = (f"ring procs={procs:2d} part={part:3d}MiB{extra}: {r['GBps']:5.1f} GB/s ({r['s'] * 1e3:.0f} ms), "
                    f"spawn {r['spawn_s'] * 1e3:.0f} ms, page-lock {r['lock_s'] * 1e3:.0f} ms, equal {ok}, "
                    f"exits {r['exit_codes']}")
            print(line, flush=True)
            rows.append(line)
    finally:
        remove_probe_file(path)
    print("\n".join(["", f"summary ({size / 1e9:.2f} GB file, {dev}):"] + rows))


if __name__ == "__main__":
    main()
