"""Restore probe for issue 5: page-lock the page cache *in place* from several processes.

Why: a restore that reads into pinned buffers costs the host a copy of every byte, and this
host's memory tops out near 42 GB/s for that (``BENCHMARKS.md``, eighth and twelfth
sessions), below the 44 GB/s that 80% of host-to-device needs. Page-locking the file's
read-only map in place (``cudaHostRegister``) lets the copy engine read the page cache with
no CPU copy, but one process registers at only 10-12 GB/s and its threads do not register in
parallel (eighth session). This probe asks whether *processes* do: N helpers
(``inplace_worker.py``, no torch) each open the destination over CUDA IPC, register their
parts of the file and copy each part straight to the device.

Prints one line per variant: end-to-end GB/s from "go" to the last copy done, the helpers'
start-up, their summed registration time, and whether the bytes arrived. Baseline in the same
run: one process registering and copying in parts (``restore_probe.pipeline_probe``).

Run on a GPU machine: ``python3 benchmarks/inplace_procs.py [--file-gb 4] [--variants 1x64,4x64]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ring_readers import probe_file, remove_probe_file  # (benchmarks/ is on the path when this runs)

MiB = 1 << 20
WORKER = str(Path(__file__).with_name("inplace_worker.py"))


def cudart_path() -> str:
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if "libcudart" in line})[0]


def ipc_handle(base: int) -> bytes:
    import ctypes

    lib = ctypes.CDLL(cudart_path())
    h = (ctypes.c_char * 64)()
    err = lib.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base))
    if err:
        raise RuntimeError(f"cudaIpcGetMemHandle: cudaError {err}")
    return bytes(h)


def run_variant(dev: torch.device, path: str, size: int, procs: int, part: int) -> dict[str, float]:
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)
    shared = dst.untyped_storage()._share_cuda_()
    offset = shared[3]  # (the block's offset in its cudaMalloc segment; the handle we take ourselves,
    # since torch's "shareable handle" format changes between versions)
    handle = ipc_handle(dst.data_ptr() - offset)
    parts = [(k * part, k * part, min(part, size - k * part)) for k in range((size + part - 1) // part)]
    lib = cudart_path()
    free0 = torch.cuda.mem_get_info(dev)[0]
    kids = []
    t_start = time.perf_counter()
    for i in range(procs):
        p = subprocess.Popen([sys.executable, "-I", "-S", WORKER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        job = {"lib": lib, "device": dev.index or 0, "handle": handle.hex(), "offset": offset,
               "path": path, "size": size, "parts": parts[i::procs]}
        p.stdin.write(json.dumps(job) + "\n")
        p.stdin.flush()
        kids.append(p)
    ready = [json.loads(p.stdout.readline())["ready"] for p in kids]
    started_s = time.perf_counter() - t_start
    ctx_mib = (free0 - torch.cuda.mem_get_info(dev)[0]) / procs / 2**20
    t0 = time.perf_counter()
    for p in kids:
        p.stdin.write("go\n")
        p.stdin.flush()
    done = [json.loads(p.stdout.readline())["done"] for p in kids]
    total = time.perf_counter() - t0
    closed = [json.loads(p.stdout.readline())["closed"] for p in kids]
    for p in kids:
        p.stdin.close()
        p.wait(timeout=30)
    want = torch.from_numpy(np.fromfile(path, dtype=np.uint8)).to(dev)
    equal = bool(torch.equal(want, dst))
    del want, dst
    torch.cuda.empty_cache()
    return {"GBps": size / total / 1e9, "s": total, "start_s": started_s, "setup_max_s": max(ready), "ctx_MiB": ctx_mib,
            "reg_GBps_per_proc": sum(d["reg_s"] for d in done) and size / sum(d["reg_s"] for d in done) / 1e9,
            "issued_max_s": max(d["issued_s"] for d in done), "unregister_max_s": max(closed),
            "equal": float(equal)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--file-gb", type=float, default=4.0)
    ap.add_argument("--dir", default=None, help="where the file goes (default /dev/shm)")
    ap.add_argument("--variants", default="1x64,2x64,4x64,6x64,8x64,12x64,8x16,8x256",
                    help="helper processes x part MiB, comma-separated")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--baseline", action="store_true", help="also one process registering in parts")
    args = ap.parse_args()
    dev = torch.device("cuda")
    path, size = probe_file(args.file_gb, args.dir)
    rows: list[str] = []
    try:
        if args.baseline:
            from restore_probe import pipeline_probe

            for _ in range(args.repeat):
                r = pipeline_probe(dev, path, size, 1, 64 * MiB)
                rows.append(f"one process, 1 thread x 64 MiB: {r['GBps']:6.1f} GB/s  " + " ".join(
                    f"{k}={v:.3g}" for k, v in r.items()))
                print(rows[-1], flush=True)
        for _ in range(args.repeat):
            for v in args.variants.split(","):
                n, mib = (int(x) for x in v.split("x"))
                r = run_variant(dev, path, size, n, mib * MiB)
                rows.append(f"{n:2d} procs x {mib:3d} MiB: {r['GBps']:6.1f} GB/s  " + " ".join(
                    f"{k}={v:.3g}" for k, v in r.items() if k != "GBps"))
                print(rows[-1], flush=True)
    finally:
        remove_probe_file(path)
    print("\n".join(["", "summary (file %.2f GB):" % (size / 1e9)] + rows))


if __name__ == "__main__":
    main()
