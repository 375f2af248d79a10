"""Snapshot copy of a training state: the gather kernel against ``_foreach_copy_`` of views.

A GPT-2 state's storages (model + two AdamW moments per parameter, as ``save()`` snapshots
them) are copied into one buffer, each 16-byte aligned, by:
  * ``gather``: ``kernels.gather_copy`` (address table, one launch);
  * ``foreach``: a uint8 alias per storage, ``split`` of the buffer, one ``_foreach_copy_``
    (the window's path before the gather kernel, and still its path without Triton);
  * ``clone``: one device-to-device copy of a single tensor of the same total size (the
    device's copy rate, for reference).
Host time is the enqueueing thread's; GPU time is between events around the copy; best of
``--repeat``. Checks the gather's bytes against the foreach's. Usage (on the GPU machine):
``python3 benchmarks/gather_copy_bench.py --model gpt2-large``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from gpusnap.kernels.gather_copy import gather_copy, gather_copy_tensors


def state_storages(model_name: str) -> list[torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    dims = {"gpt2": (12, 768, 12), "gpt2-large": (36, 1280, 20)}[model_name]
    cfg = GPT2Config(n_layer=dims[0], n_embd=dims[1], n_head=dims[2])
    with torch.device("cuda"):
        model = GPT2LMHeadModel(cfg)
    params = list(model.parameters()) + list(model.buffers())
    return params + [torch.zeros_like(p) for p in model.parameters()] * 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time tile size x block x warps")
    args = ap.parse_args()
    tensors = state_storages(args.model)
    storages = [t.untyped_storage() for t in tensors]
    sizes = np.array([s.nbytes() for s in storages], dtype=np.int64)
    padded = sizes + (-sizes % 16)
    offsets = np.cumsum(padded) - padded
    total = int(padded.sum())
    buffer = torch.empty(total, dtype=torch.uint8, device="cuda")
    template = torch.empty(0, dtype=torch.uint8, device="cuda")

    def gather() -> None:
        addrs = np.fromiter((s.data_ptr() for s in storages), dtype=np.int64, count=len(storages))
        gather_copy(buffer, offsets, addrs, sizes)

    def foreach() -> None:
        views = [template.new_empty(0).set_(s, 0, (s.nbytes(),), (1,)) for s in storages]
        gather_copy_tensors(buffer, offsets.tolist(), views)

    big = torch.empty(int(sizes.sum()), dtype=torch.uint8, device="cuda")

    def clone() -> None:
        buffer[: big.numel()].copy_(big)

    res: dict[str, object] = {"model": args.model, "storages": len(storages), "bytes": int(sizes.sum()),
                              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d")}
    for name, fn in (("gather", gather), ("foreach", foreach), ("clone", clone)):
        fn()  # compile / warm
        torch.cuda.synchronize()
        host, gpu = [], []
        for _ in range(args.repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end) / 1e3)
        res[name] = {"host_s": min(host), "gpu_s": min(gpu), "gb_s": int(sizes.sum()) / min(gpu) / 1e9}
    if args.sweep:
        sweep = res["sweep"] = []
        for tile in (1 << 18, 1 << 20, 1 << 22):
            for block in (1024, 2048, 4096):
                for warps in (4, 8, 16):
                    def fn(tile=tile, block=block, warps=warps) -> None:
                        addrs = np.fromiter((s.data_ptr() for s in storages), dtype=np.int64, count=len(storages))
                        gather_copy(buffer, offsets, addrs, sizes, tile_bytes=tile, block_words=block, num_warps=warps)
                    fn()
                    torch.cuda.synchronize()
                    best = min(_gpu_time(fn) for _ in range(args.repeat))
                    sweep.append({"tile": tile, "block": block, "warps": warps, "gpu_s": best})
        sweep.sort(key=lambda r: r["gpu_s"])
        for r in sweep[:6]:
            print(f"sweep: tile {r['tile'] >> 10} KiB, block {r['block']}, warps {r['warps']}: "
                  f"{r['gpu_s'] * 1e3:.2f} ms, {int(sizes.sum()) / r['gpu_s'] / 1e9:.0f} GB/s")
    foreach()
    want = buffer.clone()
    buffer.zero_()
    gather()
    res["gather_equals_foreach"] = bool(torch.equal(buffer, want))
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\n{args.model}: {len(storages)} storages, {sizes.sum() / 1e9:.2f} GB; gather == foreach: {res['gather_equals_foreach']}")
    print(f"{'':<10}{'host ms':>10}{'GPU ms':>10}{'GB/s':>10}")
    for name in ("gather", "foreach", "clone"):
        r = res[name]
        print(f"{name:<10}{r['host_s'] * 1e3:>10.2f}{r['gpu_s'] * 1e3:>10.2f}{r['gb_s']:>10.0f}")  # type: ignore[index]


def _gpu_time(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


if __name__ == "__main__":
    main()
