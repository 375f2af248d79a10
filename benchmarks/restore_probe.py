"""What bounds the restore's copy thread, and what the host can feed it (GPU diagnostic).

Three probes, each printing one table row per variant:

1. ``copy``: the copy thread's per-piece work alone, on GPT-2 large training state's tensor
   sizes (9.3 GB, 1745 tensors), data already in pinned regions: H2D into a scratch slot, the
   device hash, the comparison, the flags copy, one event, then the device-to-device copy
   into the target. Variants: alone, with 6 simulated readers (threads reading a tmpfs file
   into pinned buffers, as the loader's readers do), and without the hash. Tells whether the copy thread is bound by its own calls or by
   competing for the GIL.
2. ``read``: the readers' ceiling: N threads reading a tmpfs file into pinned buffers.
3. ``register``: a tmpfs file mapped and page-locked in place (``cudaHostRegister``), then
   copied host-to-device straight from the page cache: registration cost and copy rate.
5. ``pipe``: the copy loop of (1) on whole 32 MiB pieces only, on one stream or with the
   H2D copies on a stream of their own, 3 or 6 scratch slots: whether the device side (one
   stream running H2D, hash and D2D in turn) bounds the loop rather than its host calls.
4. ``pipeline``: the same, in parts: T threads register parts (through ctypes, so without
   the GIL) while the main thread copies each part once it is registered, each copy within
   one registration. Tells whether page-locking the page cache in parallel can feed the
   copy engine faster than readers copying into pinned buffers.
Run: PYTHONPATH=src python3 benchmarks/restore_probe.py
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gpusnap.kernels.chunk_hash import chunk_hashes
from ring_readers import cudart, probe_file, remove_probe_file  # (benchmarks/ is on the path when this runs)

MiB = 1 << 20
CHUNK = 4 * MiB


def gpt2_large_sizes() -> list[int]:
    """Byte sizes of GPT-2 large's parameters, three times (weights and two AdamW moments)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=36, n_embd=1280, n_head=20))
    sizes = [p.numel() * 4 for p in model.parameters()]
    return sizes * 3


def pieces_of(sizes: list[int], piece: int) -> list[tuple[int, int, int]]:
    """(tensor, offset, nbytes) pieces of at most ``piece`` bytes each."""
    out = []
    for i, n in enumerate(sizes):
        for off in range(0, n, piece):
            out.append((i, off, min(piece, n - off)))
    return out


class Background:
    """``n`` threads running ``body`` in a loop until stopped."""

    def __init__(self, n: int, body: Callable[[int], None]) -> None:
        self.stop = threading.Event()
        self.count = [0] * n

        def run(k: int) -> None:
            while not self.stop.is_set():
                body(k)
                self.count[k] += 1

        self.threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(n)]

    def __enter__(self) -> Background:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


class BackgroundProcs:
    """``n`` processes reading ``path`` in 32 MiB pieces into their own memory until stopped:
    the same host load as ``Background(n, reader_body(...))`` without a GIL shared with the
    copy thread. Tells GIL contention apart from contention for memory bandwidth."""

    LOOP = (
        "import mmap, os, sys, select\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY); size = os.fstat(fd).st_size\n"
        "buf = mmap.mmap(-1, 32 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, 'MAP_POPULATE', 0))\n"
        "view = memoryview(buf); off = int(sys.argv[2]) % (size - (32 << 20))\n"
        "sys.stdout.write('r'); sys.stdout.flush()\n"
        "while not select.select([sys.stdin], [], [], 0)[0]:\n"
        "    os.preadv(fd, [view], off); off = (off + (32 << 20)) % (size - (32 << 20))\n"
    )

    def __init__(self, n: int, path: str) -> None:
        self.n, self.path = n, path

    def __enter__(self) -> BackgroundProcs:
        import subprocess
        import sys

        self.procs = [subprocess.Popen([sys.executable, "-c", self.LOOP, self.path, str(k * 32 * MiB)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE) for k in range(self.n)]
        for p in self.procs:
            p.stdout.read(1)  # ready
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            p.stdin.write(b"x")
            p.stdin.close()
        for p in self.procs:
            p.wait(timeout=30)


def reader_body(path: str, size: int, n: int) -> Callable[[int], None]:
    bufs = [torch.empty(32 * MiB, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    views = [memoryview(b.numpy()) for b in bufs]
    fds = [os.open(path, os.O_RDONLY) for _ in range(n)]
    pos = [k * 32 * MiB % size for k in range(n)]

    def body(k: int) -> None:
        off = pos[k]
        os.preadv(fds[k], [views[k]], off)
        pos[k] = (off + 32 * MiB) % (size - 32 * MiB)

    return body


def copy_probe(dev: torch.device, sizes: list[int], hash_on: bool, piece: int = 32 * MiB, *,
               slots: int = 3, two_streams: bool = False) -> dict[str, float]:
    """``two_streams``: the H2D copies on a stream of their own (the next piece's H2D need not
    wait behind this piece's hash and D2D on one stream); ``slots``: device scratch slots."""
    targets = [torch.empty(n, dtype=torch.uint8, device=dev) for n in sizes]
    regions = [torch.randint(0, 255, (piece,), dtype=torch.uint8).pin_memory() for _ in range(8)]
    scratch = [torch.empty(piece, dtype=torch.uint8, device=dev) for _ in range(slots)]
    rows = piece // CHUNK
    got = [torch.empty((rows, 2), dtype=torch.int64, device=dev) for _ in range(slots)]
    bad = [torch.empty(rows, dtype=torch.bool, device=dev) for _ in range(slots)]
    flags = [torch.zeros(rows, dtype=torch.bool).pin_memory() for _ in range(slots)]
    want = torch.zeros((rows * 4, 2), dtype=torch.int64, device=dev)
    stream = torch.cuda.Stream(dev)
    h2d = torch.cuda.Stream(dev) if two_streams else stream
    freed: list[Any] = [None] * slots  # two streams: the slot's D2D is done (its next H2D may start)
    plan = pieces_of(sizes, piece)
    t_calls = {"h2d": 0.0, "hash": 0.0, "check": 0.0, "event": 0.0, "wait": 0.0, "d2d": 0.0}
    pend: list[Any] = [None] * slots
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        for k, (i, off, n) in enumerate(plan):
            s = k % slots
            if pend[s] is not None:  # resolve the slot's previous piece: flags, then D2D
                a = time.perf_counter()
                ev, (pi, poff, pn) = pend[s]
                ev.synchronize()
                b = time.perf_counter()
                _ = flags[s].numpy().any()
                targets[pi][poff : poff + pn].copy_(scratch[s][:pn])
                if two_streams:
                    freed[s] = torch.cuda.Event()
                    freed[s].record(stream)
                c = time.perf_counter()
                t_calls["wait"] += b - a
                t_calls["d2d"] += c - b
            a = time.perf_counter()
            if two_streams:
                with torch.cuda.stream(h2d):
                    if freed[s] is not None:
                        h2d.wait_event(freed[s])
                    scratch[s][:n].copy_(regions[k % 8][:n], non_blocking=True)
                    landed = torch.cuda.Event()
                    landed.record(h2d)
                stream.wait_event(landed)
            else:
                scratch[s][:n].copy_(regions[k % 8][:n], non_blocking=True)
            b = time.perf_counter()
            r = -(-n // CHUNK)
            if hash_on:
                chunk_hashes(scratch[s][:n], CHUNK, out=got[s][:r])
            c = time.perf_counter()
            if hash_on:
                torch.any(got[s][:r] != want[:r], dim=1, out=bad[s][:r])
                flags[s][:r].copy_(bad[s][:r], non_blocking=True)
            d = time.perf_counter()
            ev = torch.cuda.Event(blocking=True)
            ev.record(stream)
            e = time.perf_counter()
            pend[s] = (ev, (i, off, n))
            t_calls["h2d"] += b - a
            t_calls["hash"] += c - b
            t_calls["check"] += d - c
            t_calls["event"] += e - d
    torch.cuda.synchronize(dev)
    secs = time.perf_counter() - t0
    total = sum(sizes)
    del targets, regions, scratch
    torch.cuda.empty_cache()
    out = {"s": secs, "GBps": total / secs / 1e9, "pieces": len(plan)}
    out.update({f"{k}_us": v / len(plan) * 1e6 for k, v in t_calls.items()})
    return out


def read_probe(path: str, size: int, threads: int, seconds: float = 2.0) -> float:
    body = reader_body(path, size, threads)
    with Background(threads, body) as bg:
        time.sleep(0.3)
        c0 = sum(bg.count)
        t0 = time.perf_counter()
        time.sleep(seconds)
        c1 = sum(bg.count)
        t1 = time.perf_counter()
    return (c1 - c0) * 32 * MiB / (t1 - t0) / 1e9


def register_probe(dev: torch.device, path: str, size: int, flags: int, parts: int) -> dict[str, float]:
    cudart = torch.cuda.cudart()
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8)  # a read-only map: its address through numpy
    addr = arr.ctypes.data
    part = size // parts
    t0 = time.perf_counter()
    errs = []

    def reg(k: int) -> None:
        err = cudart.cudaHostRegister(addr + k * part, part, flags)
        errs.append(int(getattr(err, "value", err)))

    ths = [threading.Thread(target=reg, args=(k,)) for k in range(parts)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    t_reg = time.perf_counter() - t0
    out: dict[str, float] = {"register_s": t_reg, "register_GBps": size / t_reg / 1e9, "err": max(errs)}
    if max(errs) == 0:
        src = torch.from_numpy(arr)  # read-only warning is fine: we only read
        dst = torch.empty(size, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dev)
        t_copy = time.perf_counter() - t0
        out.update(copy_s=t_copy, copy_GBps=size / t_copy / 1e9, pinned=float(src.is_pinned()))
        ok = torch.equal(dst[: 1 << 20].cpu(), src[: 1 << 20])
        out["equal"] = float(ok)
        del dst
        t0 = time.perf_counter()
        for k in range(parts):
            cudart.cudaHostUnregister(addr + k * part)
        out["unregister_s"] = time.perf_counter() - t0
        del src
    del arr
    mm.close()
    torch.cuda.empty_cache()
    return out


def pipeline_probe(dev: torch.device, path: str, size: int, threads: int, part: int) -> dict[str, float]:
    """Register parts of a read-only map on ``threads`` threads; copy each part once registered."""
    import queue

    lib = cudart()  # (through ctypes: its calls release the GIL)
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8)
    addr = arr.ctypes.data
    src = torch.from_numpy(arr)
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    nparts = size // part
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for k in range(nparts):
        todo.put(k)
    done: queue.SimpleQueue[tuple[int, int, float]] = queue.SimpleQueue()

    def reg() -> None:
        while True:
            try:
                k = todo.get_nowait()
            except queue.Empty:
                return
            t = time.perf_counter()
            err = lib.cudaHostRegister(addr + k * part, part, 8)
            done.put((k, err, time.perf_counter() - t))

    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    ths = [threading.Thread(target=reg) for _ in range(threads)]
    for t in ths:
        t.start()
    errs, reg_s = 0, 0.0
    with torch.cuda.stream(stream):
        for _ in range(nparts):
            k, err, s = done.get()
            errs, reg_s = max(errs, err), reg_s + s
            if err == 0:
                dst[k * part : (k + 1) * part].copy_(src[k * part : (k + 1) * part], non_blocking=True)
    registered = time.perf_counter() - t0
    stream.synchronize()
    total = time.perf_counter() - t0
    for t in ths:
        t.join()
    out = {"GBps": size / total / 1e9, "s": total, "registered_s": registered,
           "reg_GBps_per_thread": size / reg_s / 1e9 if reg_s else 0.0, "err": float(errs)}
    if errs == 0:
        idx = torch.randint(0, size, (1 << 16,))
        out["equal"] = float(torch.equal(dst[idx.to(dev)].cpu(), src[idx]))
    t0 = time.perf_counter()
    for k in range(nparts):
        lib.cudaHostUnregister(addr + k * part)
    out["unregister_s"] = time.perf_counter() - t0
    del src, dst, arr
    mm.close()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--probes", default="copy,read,register,pipeline")
    ap.add_argument("--file-gb", type=float, default=4.0)
    ap.add_argument("--dir", default=None,
                    help="where the probe file goes (default /dev/shm): e.g. a tmpfs mounted with huge=always")
    args = ap.parse_args()
    dev = torch.device("cuda")
    probes = args.probes.split(",")
    path, size = probe_file(args.file_gb, args.dir)
    rows: list[str] = []
    try:
        if "copy" in probes:
            sizes = gpt2_large_sizes()
            copy_probe(dev, sizes[:50], True)  # warm the kernels
            variants = [
                ("alone", None, True),
                ("6 readers", lambda: Background(6, reader_body(path, size, 6)), True),
                # (six threads running pure Python starved the probe on the H200: removed)
                ("12 readers", lambda: Background(12, reader_body(path, size, 12)), True),
                ("6 reader procs", lambda: BackgroundProcs(6, path), True),
                ("12 reader procs", lambda: BackgroundProcs(12, path), True),
                ("alone, no hash", None, False),
                ("6 readers, no hash", lambda: Background(6, reader_body(path, size, 6)), False),
            ]
            for name, bg, hash_on in variants:
                if bg is None:
                    r = copy_probe(dev, sizes, hash_on)
                else:
                    with bg():
                        r = copy_probe(dev, sizes, hash_on)
                line = (f"copy  {name:22s} {r['GBps']:6.1f} GB/s {r['s'] * 1e3:7.0f} ms  per piece us: "
                        + " ".join(f"{k[:-3]}={r[k]:.0f}" for k in r if k.endswith("_us")))
                print(line, flush=True)
                rows.append(line)
        if "pipe" in probes:  # whole 32 MiB pieces only: is one stream the device-side bound?
            sizes = [32 * MiB] * 256  # 8.6 GB
            copy_probe(dev, sizes[:8], True)  # warm the kernels
            for name, hash_on, slots, two in (("1 stream, 3 slots", True, 3, False), ("2 streams, 3 slots", True, 3, True),
                                              ("1 stream, 6 slots", True, 6, False), ("2 streams, 6 slots", True, 6, True),
                                              ("1 stream, no hash", False, 3, False), ("2 streams, no hash", False, 3, True)):
                r = copy_probe(dev, sizes, hash_on, slots=slots, two_streams=two)
                line = (f"pipe  {name:22s} {r['GBps']:6.1f} GB/s {r['s'] * 1e3:7.0f} ms  per piece us: "
                        + " ".join(f"{k[:-3]}={r[k]:.0f}" for k in r if k.endswith("_us")))
                print(line, flush=True)
                rows.append(line)
            gpt2 = gpt2_large_sizes()
            for name, two in (("gpt2-large 1 stream", False), ("gpt2-large 2 streams", True)):
                r = copy_probe(dev, gpt2, True, two_streams=two)
                line = f"pipe  {name:22s} {r['GBps']:6.1f} GB/s {r['s'] * 1e3:7.0f} ms"
                print(line, flush=True)
                rows.append(line)
        if "read" in probes:
            for n in (1, 2, 4, 6, 8, 12, 16):
                line = f"read  {n:2d} threads into pinned: {read_probe(path, size, n):6.1f} GB/s"
                print(line, flush=True)
                rows.append(line)
        if "pipeline" in probes:
            for threads, part in ((1, 256 * MiB), (2, 256 * MiB), (4, 256 * MiB), (8, 256 * MiB),
                                  (4, 64 * MiB), (8, 64 * MiB), (12, 64 * MiB)):
                r = pipeline_probe(dev, path, size, threads, part)
                line = f"pipeline threads={threads:2d} part={part // MiB}MiB: " + " ".join(
                    f"{k}={v:.3g}" for k, v in r.items())
                print(line, flush=True)
                rows.append(line)
        if "register" in probes:
            # flags 8 = cudaHostRegisterReadOnly, which a read-only map needs: without it the
            # call fails (seen on the H200), and its error stays pending for the next CUDA call
            for flags, parts in ((8, 1), (8, 4), (8, 8)):
                try:
                    r = register_probe(dev, path, size, flags, parts)
                except RuntimeError as exc:  # a copy across registrations: seen to fail
                    line = f"register flags={flags} parts={parts}: failed: {str(exc).splitlines()[0]}"
                    print(line, flush=True)
                    rows.append(line)
                    break  # the error may poison the context for later probes
                line = f"register flags={flags} parts={parts}: " + " ".join(
                    f"{k}={v:.3g}" for k, v in r.items())
                print(line, flush=True)
                rows.append(line)
    finally:
        remove_probe_file(path)
    print("\n".join(["", "summary:"] + rows))


if __name__ == "__main__":
    main()
