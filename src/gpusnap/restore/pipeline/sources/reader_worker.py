"""A restore reader *process*: reads runs of pack files into the shared host regions.

Standard library only, and run with ``python -I -S``: it starts in tens of milliseconds and
shares no GIL with the restoring process, whose copy thread bounds the restore rate (every
torch call gives up the GIL and waits to get it back; BENCHMARKS.md).
Parent side and protocol: ``reader_procs.py``.

Usage: ``python -I -S reader_worker.py RING_FD RING_BYTES``. Writes one ready message once the
ring is mapped; then, per request, reads each run ``(path, file offset, length, ring
offset)`` and replies with the bytes each run got, or with the first error.
"""

from __future__ import annotations

import marshal
import mmap
import os
import signal
import struct
import sys

LEN = struct.Struct("<Q")


def send(out, obj) -> None:  # type: ignore[no-untyped-def]
    body = marshal.dumps(obj)
    out.write(LEN.pack(len(body)) + body)
    out.flush()


def read_runs(runs, view) -> list[int]:  # type: ignore[no-untyped-def]
    """Bytes got per run (short only at end of file); raises OSError (with the run's path)."""
    got_all: list[int] = []
    fds: dict[str, int] = {}
    try:
        for path, offset, length, at in runs:
            try:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                got = 0
                while got < length:
                    n = os.preadv(fd, [view[at + got : at + length]], offset + got)
                    if n == 0:
                        break
                    got += n
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, path) from None
            got_all.append(got)
    finally:
        for fd in fds.values():
            os.close(fd)
    return got_all


def main() -> None:
    # Ctrl-C is for the program, which may catch it and restore again: the readers stay
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ring_fd, ring_bytes = int(sys.argv[1]), int(sys.argv[2])
    # MAP_POPULATE: page tables filled now. Without it every reader took a minor fault per
    # 4 KiB page it first wrote: 8 readers ran at 15 GB/s instead of 22.
    ring = mmap.mmap(ring_fd, ring_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(ring_fd)
    view = memoryview(ring)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    send(out, "ready")
    while len(head := inp.read(LEN.size)) == LEN.size:
        runs = marshal.loads(inp.read(LEN.unpack(head)[0]))
        try:
            send(out, ("ok", read_runs(runs, view)))
        except OSError as exc:
            send(out, ("error", exc.errno or 0, exc.strerror or str(exc), exc.filename or ""))
    view.release()
    ring.close()


if __name__ == "__main__":
    main()
