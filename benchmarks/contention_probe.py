"""Does background host work stall a program's kernel launches? (GPU diagnostic)

A program thread launches small kernels in a loop and records the longest gap between two
iterations while another thread does one kind of background work that gpusnap does during a
capture window:
  pinned_alloc: torch.empty(256 MiB, pin_memory=True), 8 times (staging growth)
  hash:         BLAKE2b of 1 GiB in 4 MiB chunks on 12 threads (chunk digests)
  d2h:          1 GiB device-to-pinned copies in 32 MiB pieces on a low-priority stream
Run: PYTHONPATH=src python3 benchmarks/contention_probe.py
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def probe(background, seconds: float = 1.0) -> dict[str, float]:
    x = torch.randn(1024, device="cuda")
    stop = threading.Event()
    gaps: list[float] = []

    def program() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            for _ in range(20):
                x.mul_(1.0001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=program)
    t.start()
    time.sleep(0.1)
    started = time.perf_counter()
    background()
    busy = time.perf_counter() - started
    time.sleep(max(0.0, seconds - busy))
    stop.set()
    t.join()
    torch.cuda.synchronize()
    gaps.sort()
    return {"background_s": busy, "max_gap_ms": gaps[-1] * 1e3, "p99_gap_ms": gaps[int(len(gaps) * 0.99)] * 1e3,
            "median_gap_ms": gaps[len(gaps) // 2] * 1e3}


def main() -> None:
    keep: list[torch.Tensor] = []

    def pinned_alloc() -> None:
        for _ in range(8):
            keep.append(torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True))

    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    view = memoryview(host.numpy())
    pool = ThreadPoolExecutor(12)

    def hash_all() -> None:
        list(pool.map(lambda k: hashlib.blake2b(view[k : k + (4 << 20)], digest_size=16).digest(),
                      range(0, 1 << 30, 4 << 20)))

    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    low = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[0])

    def d2h() -> None:
        with torch.cuda.stream(low):
            for k in range(0, 1 << 30, 32 << 20):
                host[k : k + (32 << 20)].copy_(dev[k : k + (32 << 20)], non_blocking=True)
        low.synchronize()

    rows = {"idle": probe(lambda: None), "pinned_alloc": probe(pinned_alloc), "hash": probe(hash_all),
            "d2h": probe(d2h)}
    print(f"{'background':<14}{'busy s':>9}{'median ms':>11}{'p99 ms':>9}{'max gap ms':>12}")
    for name, r in rows.items():
        print(f"{name:<14}{r['background_s']:>9.3f}{r['median_gap_ms']:>11.3f}{r['p99_gap_ms']:>9.3f}{r['max_gap_ms']:>12.2f}")


if __name__ == "__main__":
    main()
