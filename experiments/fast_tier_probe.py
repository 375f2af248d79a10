"""Where a fast-tier save's cost on training goes (issue 22): a diagnosis, not a benchmark.

Runs the ``llama`` (or another) bench workload and measures, against its plain steps:
A. posix_fallocate of tmpfs slab files in a background thread;
B. mapping + cudaHostRegister of those slabs in a background thread (1 GiB and 128 MiB slabs);
C. a side-stream device-to-host copy into registered slab memory while training;
D. a device-to-device copy of the whole state on the program stream (the snapshot);
E. warm fast-tier saves: save()'s phases, cost over the window, every stat.

  PYTHONPATH=src python3 experiments/fast_tier_probe.py --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import threading
import time

import torch

import gpusnap
from gpusnap.bench.measure import stream_sync, timed_step
from gpusnap.bench.workloads import build_workload
from gpusnap.host_map import MappedMemory

GiB = 1 << 30


def steps_while(wl, work) -> dict:
    """Run steps while ``work`` runs in a thread; the steps' times and the work's."""
    done = threading.Event()
    out: dict = {}

    def body() -> None:
        t0 = time.perf_counter()
        try:
            out["result"] = work()
        finally:
            out["work_s"] = time.perf_counter() - t0
            done.set()

    th = threading.Thread(target=body)
    th.start()
    times = []
    while not done.is_set() or len(times) < 3:
        times.append(timed_step(wl))
    th.join()
    out["steps"] = times
    return out


def excess(times, median) -> float:
    return sum(times) - median * len(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="llama")
    ap.add_argument("--root", default="/dev/shm/gpusnap-probe")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--window", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", default="")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    shutil.rmtree(args.root, ignore_errors=True)
    os.makedirs(args.root)
    report: dict = {}
    wl = build_workload(args.workload, torch.device("cuda"), size="quick")
    for _ in range(5):
        timed_step(wl)
    plain = [timed_step(wl) for _ in range(20)]
    med = statistics.median(plain)
    state = sum(t.numel() * t.element_size() for t in wl.tensors().values())
    report["plain"] = {"median_s": med, "state_bytes": state}
    print(f"plain step {med * 1e3:.1f} ms, state {state / 1e9:.2f} GB", flush=True)

    files: list[tuple[str, int]] = []

    def falloc(n: int, size: int, tag: str):
        def work():
            made = []
            for i in range(n):
                p = os.path.join(args.root, f"{tag}{i}.slab")
                fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
                os.posix_fallocate(fd, 0, size)
                made.append((p, fd, size))
            return made
        return work

    if "A" not in skip:
        for tag, n, size in (("g", 4, GiB), ("m", 32, 128 << 20)):
            r = steps_while(wl, falloc(n, size, tag))
            files.append((tag, r["result"]))
            report[f"A_falloc_{tag}"] = {"work_s": r["work_s"], "excess_s": excess(r["steps"], med), "steps": len(r["steps"])}
            print(f"A fallocate {n}x{size >> 20} MiB: {r['work_s']:.2f} s, training excess {excess(r['steps'], med) * 1e3:.0f} ms over {len(r['steps'])} steps", flush=True)

    maps: dict[str, list[MappedMemory]] = {}
    if "B" not in skip:
        for tag, made in files:
            def reg(made=made):
                out, calls = [], []
                for _p, fd, size in made:
                    t0 = time.perf_counter()
                    out.append(MappedMemory(os.dup(fd), size, pinned=True))
                    calls.append(time.perf_counter() - t0)
                return out, calls
            r = steps_while(wl, reg)
            maps[tag], calls = r["result"]
            report[f"B_register_{tag}"] = {"work_s": r["work_s"], "excess_s": excess(r["steps"], med), "max_call_s": max(calls),
                                          "max_step_s": max(r["steps"])}
            print(f"B map+register {tag}: {r['work_s']:.2f} s (max call {max(calls) * 1e3:.0f} ms), training excess "
                  f"{excess(r['steps'], med) * 1e3:.0f} ms, max step {max(r['steps']) * 1e3:.0f} ms", flush=True)
    if "H" not in skip:
        for f in ("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "/sys/kernel/mm/transparent_hugepage/enabled"):
            try:
                print(f, open(f).read().strip(), flush=True)
            except OSError as exc:
                print(f, exc)
        os.system("mount | grep -E 'shm|tmpfs' | head -5")
        import ctypes
        import mmap as _mm
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        cudart = torch.cuda.cudart()
        for huge in (False, True):
            for size in (128 << 20, GiB):
                n = max(1, (2 * GiB) // size)
                phases = {"falloc": 0.0, "map": 0.0, "populate": 0.0, "register": 0.0}
                keep = []

                def work(size=size, n=n, huge=huge, phases=phases, keep=keep):
                    for i in range(n):
                        p = os.path.join(args.root, f"h{int(huge)}-{size}-{i}.slab")
                        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
                        t = time.perf_counter()
                        if huge:
                            os.ftruncate(fd, size)
                        else:
                            os.posix_fallocate(fd, 0, size)
                        t1 = time.perf_counter(); phases["falloc"] += t1 - t
                        addr = libc.mmap(None, size, _mm.PROT_READ | _mm.PROT_WRITE, _mm.MAP_SHARED, fd, 0)
                        t2 = time.perf_counter(); phases["map"] += t2 - t1
                        if huge:
                            rc = libc.madvise(addr, size, 14)  # MADV_HUGEPAGE
                            if rc:
                                phases["madvise_err"] = ctypes.get_errno()
                        rc = libc.madvise(addr, size, 23)  # MADV_POPULATE_WRITE
                        if rc:
                            phases["populate_err"] = ctypes.get_errno()
                        t3 = time.perf_counter(); phases["populate"] += t3 - t2
                        err = cudart.cudaHostRegister(addr, size, 0)
                        t4 = time.perf_counter(); phases["register"] += t4 - t3
                        phases.setdefault("max_register", 0.0)
                        phases["max_register"] = max(phases["max_register"], t4 - t3)
                        keep.append((addr, size, fd, p, int(getattr(err, "value", err) or 0)))
                r = steps_while(wl, work)
                meminfo = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in open("/proc/meminfo") if "Huge" in ln or "Shmem" in ln}
                for addr, sz, fd, p, err in keep:
                    if not err:
                        cudart.cudaHostUnregister(addr)
                    ctypes.CDLL(None).munmap(ctypes.c_void_p(addr), ctypes.c_size_t(sz))
                    os.close(fd)
                    os.unlink(p)
                key = f"H_{'huge' if huge else 'small'}_{size >> 20}MiB"
                report[key] = {"phases": phases, "excess_s": excess(r["steps"], med), "max_step_s": max(r["steps"]),
                               "work_s": r["work_s"], "errors": [k[4] for k in keep], "meminfo": meminfo}
                print(f"{key}: {n} x {size >> 20} MiB in {r['work_s']:.2f} s: " +
                      ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in phases.items()) +
                      f"; training excess {excess(r['steps'], med) * 1e3:.0f} ms, max step {max(r['steps']) * 1e3:.0f} ms; "
                      f"register errors {set(k[4] for k in keep)}; {meminfo.get('ShmemHugePages')}", flush=True)

    if "C" not in skip and "g" in maps:
        src = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()

        def d2h():
            with torch.cuda.stream(stream):
                for m in maps["g"]:
                    m.tensor.copy_(src[: m.nbytes], non_blocking=True)
            stream.synchronize()
        r = steps_while(wl, d2h)
        report["C_d2h_4GiB"] = {"work_s": r["work_s"], "excess_s": excess(r["steps"], med), "gbps": 4 * GiB / r["work_s"] / 1e9}
        print(f"C d2h 4 GiB side stream: {r['work_s']:.3f} s ({4 * GiB / r['work_s'] / 1e9:.1f} GB/s), training excess "
              f"{excess(r['steps'], med) * 1e3:.0f} ms", flush=True)
        del src

    if "D" not in skip:
        tensors = list(wl.tensors().values())
        buf = torch.empty(state, dtype=torch.uint8, device="cuda")
        stream_sync(wl.device)
        t0 = time.perf_counter()
        at = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            buf[at : at + n].copy_(t.detach().reshape(-1).view(torch.uint8))
            at += n
        host = time.perf_counter() - t0
        stream_sync(wl.device)
        report["D_snapshot"] = {"host_s": host, "total_s": time.perf_counter() - t0, "tensors": len(tensors)}
        print(f"D snapshot copy of {len(tensors)} tensors: host {host * 1e3:.1f} ms, done {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
        del buf
    maps.clear()  # unregistered and unmapped once the last tensor over them goes
    for _tag, made in files:
        for p, fd, _s in made:
            os.close(fd)
            os.unlink(p)

    if "E" not in skip:
        fast = os.path.join(args.root, "fast")
        ck = gpusnap.Checkpointer(os.path.join(args.root, "durable"), keep_last=2, fast_root=fast, fast_keep_last=2,
                                  promote_every=1000)
        saves = []
        for i in range(args.saves):
            stream_sync(wl.device)
            t0 = time.perf_counter()
            pending = ck.save(wl.app_state)
            call = time.perf_counter() - t0
            times = [timed_step(wl)]
            while not pending.done() or len(times) < args.window:
                times.append(timed_step(wl))
            info = pending.wait()
            row = {"call_s": call, "cost_s": call + excess(times, med), "steps": len(times), "first_step_excess_s": times[0] - med,
                   "stats": {k: v for k, v in info.stats.items() if isinstance(v, (int, float, str, dict, list, type(None)))}}
            saves.append(row)
            ph = info.stats.get("save_phases_s", {})
            top = sorted(ph.items(), key=lambda kv: -kv[1])[:6]
            print(f"E save {i}: call {call * 1e3:.0f} ms, cost {row['cost_s'] * 1e3:.0f} ms, steps {len(times)}, "
                  f"phases " + ", ".join(f"{k}={v * 1e3:.1f}" for k, v in top), flush=True)
        ck.close()
        report["E_saves"] = saves
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
