"""What coordinating the ranks costs a collective save, on CPU with gloo (docs/distributed.md).

    python benchmarks/distributed_coordination.py [--ranks 2 4 8] [--tensors 16 512 4096] [--saves 6]

For each world size it starts that many ranks (fresh interpreters, gloo over a FileStore),
and for each number of tensors (1 KiB each, per rank) makes ``--saves`` saves after one
warm-up, reporting per rank the median of:

- ``in_save_ms``: the time save() spent agreeing with the other ranks (``save_phases_s.
  coordinate``: deriving the save's id; no message is sent there), and save()'s whole stall;
- ``commit_ms``: on the writer thread, from this rank's part being durable to rank 0's
  decision (``coordination_s``): ``describe_ms`` (the part's signature of the state and its
  manifest checksum: local work, O(tensors), off the program's thread), then two store
  messages per rank, rank 0's check of the parts and its global manifest's atomic write
  (``global_write_ms``), and the wait for the slowest rank's own save (``rank0_wait_ms``:
  rank 0's wait for the parts after its own).

Printed as a table (the maximum over ranks of each median) and written as JSON. The ranks
share this machine's cores: on a small CPU the commit time is mostly the wait for the
slowest rank's own save, which grows with the ranks per core, not with the tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rank_main(rank: int, world: int, store: str, out: str, tensors: list[int], saves: int) -> None:
    import torch
    import torch.distributed as dist

    import gpusnap

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    cfg = gpusnap.Config(collective_timeout_s=120, io_threads=2, fsync=False)
    for n in tensors:
        state = {f"t{i}": torch.full((256,), float(i + rank)) for i in range(n)}
        root = Path(out).parent / f"root-{world}-{n}"
        in_save, stall, commit, describe, write, gather = [], [], [], [], [], []
        with gpusnap.Checkpointer(root, config=cfg, keep_last=2) as ck:
            for k in range(saves + 1):
                for t in state.values():
                    t.add_(1)  # every chunk changes: nothing is skipped
                dist.barrier()  # (the benchmark's own: the ranks save at the same step)
                info = ck.save(state).wait()
                if k:  # the first save joins the group and grows the staging arena
                    in_save.append(info.stats["save_phases_s"]["coordinate"] * 1e3)
                    stall.append(info.stats["stall_s"] * 1e3)
                    commit.append(info.stats["coordination_s"] * 1e3)
                    phases = info.stats["coordination_phases_s"]
                    describe.append(phases["describe"] * 1e3)
                    write.append(phases.get("commit", 0.0) * 1e3)
                    gather.append(phases.get("gather", 0.0) * 1e3)
        results[n] = {"in_save_ms": statistics.median(in_save), "stall_ms": statistics.median(stall),
                      "commit_ms": statistics.median(commit), "describe_ms": statistics.median(describe),
                      "global_write_ms": statistics.median(write), "rank0_wait_ms": statistics.median(gather)}
    Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


KEYS = ("in_save_ms", "stall_ms", "commit_ms", "describe_ms", "global_write_ms", "rank0_wait_ms")


def run(world: int, tensors: list[int], saves: int, where: Path) -> list[dict[str, dict[str, float]]]:
    store = where / f"store-{world}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--store", str(store),
                               "--out", str(where / f"rank-{world}-{r}.json"), "--tensors", *map(str, tensors),
                               "--saves", str(saves)], env=env) for r in range(world)]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"a rank of world {world} failed (exit {p.returncode})")
    return [json.loads((where / f"rank-{world}-{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tensors", type=int, nargs="+", default=[16, 512, 4096])
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.store, args.out, args.tensors, args.saves)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.ranks:
            started = time.perf_counter()
            per_rank = run(world, args.tensors, args.saves, Path(tmp))
            for n in args.tensors:
                worst = {k: max(r[str(n)][k] for r in per_rank) for k in KEYS}
                rows.append({"ranks": world, "tensors": n, **worst})
            print(f"# {world} ranks: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(f"{'ranks':>5} {'tensors':>7} {'in save() ms':>12} {'stall ms':>9} {'commit ms':>9} {'describe ms':>11} "
          f"{'global write ms':>15} {'rank 0 wait ms':>14}  (max over ranks of per-rank medians)")
    for r in rows:
        print(f"{r['ranks']:>5} {r['tensors']:>7} {r['in_save_ms']:>12.3f} {r['stall_ms']:>9.2f} {r['commit_ms']:>9.2f} "
              f"{r['describe_ms']:>11.2f} {r['global_write_ms']:>15.2f} {r['rank0_wait_ms']:>14.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu_count": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
