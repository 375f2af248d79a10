"""Which host calls of the copier's hash path wait for the GPU? (GPU diagnostic)

The copier spent 175-350 ms of host time enqueueing one hash of a GPT-2 large snapshot while
the program's step ran (BENCHMARKS.md, eighth session), about as long as the GPU took to
finish the work queued before it. Each call below runs on a side stream, once with the GPU
idle and once right after ~0.5 s of work was queued on the default stream; a call that
waits for the GPU takes ~0.5 s in the second column.
Run: PYTHONPATH=src python3 benchmarks/host_block_probe.py
"""

from __future__ import annotations

import time

import torch

from gpusnap.kernels.chunk_hash_many import chunk_hashes_packed


def main() -> None:
    dev = torch.device("cuda")
    buf = torch.randint(0, 256, (1 << 28,), dtype=torch.uint8, device=dev)
    offs = list(range(0, 1 << 28, 1 << 16))
    sizes = [1 << 16] * len(offs)
    out = torch.empty((len(offs), 2), dtype=torch.int64, device=dev)
    chunk_hashes_packed(buf, offs, sizes, 1 << 16, out)  # compile
    side = torch.cuda.Stream(dev)
    # cycles for ~0.5 s: measure the sleep kernel's rate first
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    cycles = int(100_000_000 * 0.5 / (time.perf_counter() - t))
    host = torch.empty(1 << 20, dtype=torch.int64, pin_memory=True)
    counter = iter(range(100))
    calls = {
        "pinned alloc, new size class": lambda: torch.empty((1 << (10 + next(counter))) // 8, dtype=torch.int64, pin_memory=True),
        "pinned alloc, same size": lambda: torch.empty(8192, dtype=torch.int64, pin_memory=True),
        "device alloc, new size": lambda: torch.empty((1 << 20) + 512 * next(counter), dtype=torch.uint8, device=dev),
        "H2D from pinned, non_blocking": lambda: torch.empty(8192, dtype=torch.int64, device=dev).copy_(host[:8192], non_blocking=True),
        "D2H to pinned, non_blocking": lambda: host[: out.numel()].view(-1, 2).copy_(out, non_blocking=True),
        "blocking event create+record": lambda: torch.cuda.Event(blocking=True).record(side),
        "chunk_hashes_packed (4096 spans)": lambda: chunk_hashes_packed(buf, offs, sizes, 1 << 16, out),
    }
    print(f"{'call':36s} {'GPU idle':>10s} {'GPU busy':>10s}")
    for name, fn in calls.items():
        row = []
        for busy in (False, True):
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(cycles)  # on the default stream
            with torch.cuda.stream(side):
                t = time.perf_counter()
                fn()
                row.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        print(f"{name:36s} {row[0] * 1e3:8.2f}ms {row[1] * 1e3:8.2f}ms", flush=True)


if __name__ == "__main__":
    main()
