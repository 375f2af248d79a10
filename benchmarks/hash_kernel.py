"""Chunk hash kernel on the GPU: correctness (Triton == torch on CUDA == torch on CPU) and speed.

Run on a GPU machine from the repository root (about a minute of GPU time):
    PYTHONPATH=src python3 benchmarks/hash_kernel.py --out hash_kernel.json
Smoke test anywhere (CPU, small sizes): add --tiny; with Triton installed and TRITON_INTERPRET=1
the Triton path runs too, interpreted. Prints one table last and writes JSON.

Measures, over random bytes of 64 MiB, 1 GiB and 8 GiB with 1, 4 and 16 MiB chunks: the Triton
kernel's hash rate (CUDA events, median), a small launch-shape sweep, the torch fallback on the
same GPU, the device-to-device copy rate of the same bytes (``dst.copy_(src)``: the speed the
hash should keep up with) and a pinned device-to-host copy of 1 GiB. Rates are bytes of input
per second (a copy moves each byte twice: read and write).

Then what save() pays on the calling thread for hashing a model's spans at the consistent point
(``save_like``): 440 spans of about 20 MiB (GPT-2 large has some 440 spans over 1 MiB) in 4 MiB
chunks, hashed (a) with one ``chunk_hashes`` per span and (b) with one ``chunk_hashes_many``:
host milliseconds around the calls (no synchronization inside), the device rate of (b), and
whether (a) == (b).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import traceback

import torch

from gpusnap.kernels import chunk_hash as ch
from gpusnap.kernels.chunk_hash_many import chunk_hashes_many

MiB, GiB = 1 << 20, 1 << 30
# (pairs per tile, warps, prefetch the next tile): 56 to 128 registers per thread on sm_90
SWEEP = [(512, 4, True), (1024, 4, False), (1024, 4, True), (1024, 8, True), (2048, 4, True),
         (2048, 8, False), (2048, 8, True), (4096, 8, True), (4096, 16, True)]


def timed(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()``: CUDA events on a GPU, wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 1)


def attempt(report: dict, what: str, fn):
    """``fn()``, or None with the error recorded: one failing kernel must not hide the rest."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        traceback.print_exc()
        report["failures"].append(f"{what}: {exc!r}"[:600])
        return None


def triton_fn(data: torch.Tensor, chunk: int, config: ch.TritonConfig):
    out = torch.empty((ch.num_chunks(data.numel(), chunk), 2), dtype=torch.int64,
                      device=data.device)
    return lambda: ch._hash_triton(data, chunk, out, config)


def save_like(device: torch.device, tiny: bool, reps: int) -> dict:
    """Host time of hashing many spans per call of one save: one call per span vs one call."""
    count, span, chunk = (40, 256 << 10, 64 << 10) if tiny else (440, 20 * MiB, 4 * MiB)
    sizes = [span - (i % 7) * 1000 - (i % 3) for i in range(count)]  # short last chunks, tails
    starts = [sum(-(-n // 512) * 512 for n in sizes[:i]) for i in range(count)]
    buf = torch.randint(0, 256, (starts[-1] + sizes[-1],), dtype=torch.uint8, device=device)
    spans = [buf[a : a + n] for a, n in zip(starts, sizes)]
    rows = [ch.num_chunks(n, chunk) for n in sizes]
    firsts = [sum(rows[:i]) for i in range(count)]
    outs = [torch.empty((sum(rows), 2), dtype=torch.int64, device=device) for _ in range(2)]
    one_outs = [outs[0][f : f + r] for f, r in zip(firsts, rows)]

    def per_span() -> None:
        for s, o in zip(spans, one_outs):
            ch.chunk_hashes(s, chunk, out=o)

    def many() -> None:
        chunk_hashes_many(spans, chunk, outs[1])

    def host_ms(fn) -> float:
        fn()  # warm: compiles, caches
        times = []
        for _ in range(max(reps, 5)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return round(statistics.median(times) * 1e3, 3)

    result = {"spans": count, "bytes": buf.numel(), "chunk": chunk, "rows": sum(rows),
              "per_span_host_ms": host_ms(per_span), "many_host_ms": host_ms(many)}
    result["many_GBps"] = gbps(buf.numel(), timed(many, device, reps))
    result["equal"] = bool(torch.equal(outs[0], outs[1]))
    if not result["equal"]:
        raise AssertionError(f"chunk_hashes_many != chunk_hashes per span: {result}")
    print("save_like", result, flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small sizes: a smoke test, any device")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # TRITON_INTERPRET=1 runs the Triton path on the CPU too (slowly: a check of this script)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    use_triton = ch.triton is not None and (device.type == "cuda" or interpret)
    sizes = [1 * MiB, 8 * MiB] if args.tiny else [64 * MiB, 1 * GiB, 8 * GiB]
    chunks = [64 << 10, 1 * MiB] if args.tiny else [1 * MiB, 4 * MiB, 16 * MiB]
    sample = 8 * MiB if args.tiny else 256 * MiB  # bytes also hashed on the CPU
    reps = 3 if args.tiny else args.reps
    report: dict = {
        "env": {
            "torch": torch.__version__,
            "triton": getattr(ch.triton, "__version__", None),
            "python": platform.python_version(),
            "device": (torch.cuda.get_device_name() if device.type == "cuda"
                       else platform.processor()),
            "cpu_threads": torch.get_num_threads(),
            "default_config": vars(ch.DEFAULT_TRITON_CONFIG),
        },
        "sweep": [], "hash": [], "cpu_equal": [], "copies": {}, "failures": [],
    }
    t_start = time.time()
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.randint(0, 256, (max(sizes) + 12345,), dtype=torch.uint8, device=device,
                        generator=gen)

    # 1. launch-shape sweep on 1 GiB (or the largest tiny size) with 4 MiB chunks
    best = ch.DEFAULT_TRITON_CONFIG
    if use_triton and not args.no_sweep:
        data, chunk = src[: sizes[1]], chunks[1]
        want = ch.chunk_hashes(data, chunk, impl="torch")
        best_rate = 0.0
        for block, warps, prefetch in SWEEP:
            config = ch.TritonConfig(block, warps, prefetch)

            def measure(config=config) -> tuple[bool, float]:
                got = torch.empty_like(want)
                ch._hash_triton(data, chunk, got, config)
                equal = bool(torch.equal(got, want))
                return equal, gbps(data.numel(), timed(triton_fn(data, chunk, config), device,
                                                       reps))

            result = attempt(report, f"sweep {config}", measure)
            if result is None:
                continue
            equal, rate = result
            report["sweep"].append({**vars(config), "GBps": rate, "equal": equal})
            print(f"sweep {config}: {rate:8.1f} GB/s equal={equal}", flush=True)
            if not equal:
                report["failures"].append(f"sweep {config} differs from torch")
            elif rate > best_rate:
                best, best_rate = config, rate
        report["best_config"] = vars(best)

    # 2. every size x chunk (plus small chunks, which take the other kernel): equality with
    # the torch fallback on the GPU, and speeds
    cases = [(size, chunk) for size in sizes for chunk in chunks]
    cases += [(sizes[0], 4 << 10), (sizes[0], 64 << 10)]
    copy_rates: dict[int, float] = {}
    for size, chunk in cases:
        data = src[:size]
        if size not in copy_rates:
            dst = torch.empty_like(data)
            copy_rates[size] = gbps(size, timed(lambda d=dst, s=data: d.copy_(s), device, reps))
            del dst  # frees the copy's destination before hashing
        row = {"size": size, "chunk": chunk, "copy_GBps": copy_rates[size]}
        want = ch.chunk_hashes(data, chunk, impl="torch")
        configs = {"triton_GBps": best, "default_GBps": ch.DEFAULT_TRITON_CONFIG}
        for key, config in configs.items() if use_triton else ():
            if key == "default_GBps" and config == best:
                continue
            got = torch.empty_like(want)

            def run(g=got, d=data, k=chunk, c=config) -> torch.Tensor:
                ch._hash_triton(d, k, g, c)
                return g

            if attempt(report, f"triton {config} {size=} {chunk=}", run) is None:
                continue
            if key == "triton_GBps":
                row["equal_torch_cuda"] = bool(torch.equal(got, want))
                if not row["equal_torch_cuda"]:
                    report["failures"].append(f"triton != torch for {size=} {chunk=}")
            row[key] = gbps(size, timed(triton_fn(data, chunk, config), device, reps))
        if size == sizes[1] or args.tiny:  # the fallback is slow: time it on one size
            fallback = lambda d=data, c=chunk: ch.chunk_hashes(d, c, impl="torch")
            row["torch_GBps"] = gbps(size, timed(fallback, device, 3, warmup=1))
        report["hash"].append(row)
        print(row, flush=True)

    # 3. equality with the CPU implementation: the first chunks of the input, and the last
    # chunks of an input whose length is no multiple of anything (a short last chunk, at an
    # offset past 2**31 bytes on the GPU)
    odd = src
    for chunk in chunks:
        k = max(1, sample // chunk)
        rows = ch.num_chunks(odd.numel(), chunk)
        parts = (("head", src[: k * chunk], slice(None)),
                 ("tail", odd, slice(max(0, rows - k), None)))
        for name, data, keep in parts:
            dev = attempt(report, f"default path {chunk=} {name}",
                          lambda d=data, c=chunk: ch.chunk_hashes(d, c))  # Triton if there
            if dev is None:
                continue
            dev = dev[keep].cpu()
            host = data[(keep.start or 0) * chunk :].cpu()
            t0 = time.perf_counter()
            cpu = ch.chunk_hashes(host, chunk)
            cpu_s = time.perf_counter() - t0
            equal = bool(torch.equal(dev, cpu))
            report["cpu_equal"].append({"chunk": chunk, "part": name, "bytes": host.numel(),
                                        "equal": equal, "cpu_GBps": gbps(host.numel(), cpu_s)})
            if not equal:
                report["failures"].append(f"device != cpu for {chunk=} {name}")

    # 4. copies for comparison
    if device.type == "cuda":
        n = min(1 * GiB, max(sizes))
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        d2h = lambda: host.copy_(src[:n], non_blocking=True)
        report["copies"]["pinned_d2h_GBps"] = gbps(n, timed(d2h, device, 5))
        report["copies"]["pinned_d2h_bytes"] = n

    # 5. what one call costs the host (enqueue only) for a 4 MiB storage in 1 MiB chunks
    small = src[: 4 * MiB]
    calls = 200
    ch.chunk_hashes(small, 1 * MiB)
    t0 = time.perf_counter()
    for _ in range(calls):
        ch.chunk_hashes(small, 1 * MiB)
    report["enqueue_us_per_call"] = round((time.perf_counter() - t0) / calls * 1e6, 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    src = small = None  # frees the 8 GiB input before the save-like spans
    report["save_like"] = attempt(report, "save_like", lambda: save_like(device, args.tiny, reps))
    report["wall_s"] = round(time.time() - t_start, 1)

    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print_table(report, use_triton)


def print_table(report: dict, use_triton: bool) -> None:
    print("\n" + json.dumps(report["env"]))
    if report.get("best_config"):
        print(f"best launch shape: {report['best_config']}")
    print(f"{'MiB':>6} {'chunk KiB':>9} {'triton GB/s':>12} {'default':>8} {'torch GB/s':>11} "
          f"{'copy GB/s':>10} {'equal':>6}")
    for row in report["hash"]:
        print(f"{row['size'] // MiB:>6} {row['chunk'] >> 10:>9} "
              f"{row.get('triton_GBps', '-'):>12} {row.get('default_GBps', '-'):>8} "
              f"{row.get('torch_GBps', '-'):>11} {row['copy_GBps']:>10} "
              f"{row.get('equal_torch_cuda', '-')!s:>6}")
    cpu = report["cpu_equal"]
    print(f"device == cpu on {len(cpu)} samples: {all(c['equal'] for c in cpu)}; "
          f"copies: {report['copies']}; enqueue: {report['enqueue_us_per_call']} us/call; "
          f"wall {report['wall_s']} s")
    if report.get("save_like"):
        sl = report["save_like"]
        print(f"save-like: {sl['spans']} spans, {sl['bytes'] / 1e9:.1f} GB, host "
              f"{sl['per_span_host_ms']} ms one call per span vs {sl['many_host_ms']} ms one "
              f"call; many {sl['many_GBps']} GB/s; equal={sl['equal']}")
    print("FAILURES: " + "; ".join(report["failures"]) if report["failures"] else "all equal")
    if not use_triton:
        print("(no Triton on this device: torch implementation only)")


if __name__ == "__main__":
    main()
