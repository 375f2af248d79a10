"""A reader process for ``benchmarks/ring_readers.py``: standard library only, so that it
starts in milliseconds and holds no GIL the restoring process needs.

Usage (by ring_readers.py): ``python3 ring_reader_worker.py DATA_PATH RING_FD RING_BYTES``.
Once the file is open and the ring mapped, writes 8 bytes (all ones) on stdout: ready.
Then reads commands from stdin, 24 bytes each: ring offset, file offset, length (three
little-endian uint64). Reads that many bytes of the file into the ring (a shared memory
file, mapped here and page-locked in the parent), then writes the ring offset back (8
bytes) on stdout. Exits at end of input.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys

CMD = struct.Struct("<QQQ")
DONE = struct.Struct("<Q")


def main() -> None:
    path, ring_fd, ring_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # MAP_POPULATE: the page tables are filled now, before "ready". Without it each reader
    # took a minor fault per 4 KiB page of the ring it first wrote (0.25 M per GiB, in every
    # reader): 8 readers ran at 15 GB/s on the H200, 1.9 GB/s each (twelfth session).
    ring = mmap.mmap(ring_fd, ring_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(ring)
    data = os.open(path, os.O_RDONLY)
    cmds, done = sys.stdin.buffer, sys.stdout.buffer
    done.write(DONE.pack((1 << 64) - 1))  # ready
    done.flush()
    while True:
        raw = cmds.read(CMD.size)
        if len(raw) < CMD.size:
            break
        at, offset, length = CMD.unpack(raw)
        got = 0
        while got < length:  # preadv may return short on a large read
            n = os.preadv(data, [view[at + got : at + length]], offset + got)
            if n <= 0:
                raise OSError(f"short read at {offset + got} of {path}")
            got += n
        done.write(DONE.pack(at))
        done.flush()
    view.release()
    ring.close()


if __name__ == "__main__":
    main()
