"""``gpusnap bench``: options, and the glue from parsed arguments to the bench package.

``gpusnap bench --cost`` runs the cost suite instead (``gpusnap.bench.cost_runner``: what
each checkpoint costs a training job, on the wall clock and the CPU); the quick one, from
the repository root of a GPU machine: ``PYTHONPATH=src python3 -m gpusnap bench --cost --quick``.
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["add_parser", "run"]

_ALL = ("gpt2", "gpt2-large", "llama", "resnet50", "decode")
_QUICK = ("gpt2", "gpt2-large", "decode")  # ResNet-50 is optional in --quick (asked for by name)
_CPU = ("gpt2", "decode")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser(
        "bench",
        help="measure gpusnap against torch.save, DCP, pinned copies and the CUDA driver",
        description="Runs workloads and measures gpusnap and each baseline in the same process; writes "
        "results.json, results.md and PNG plots to --out. On CPU the sizes are tiny and the figures are "
        "not performance claims.",
    )
    s.add_argument("--workload", action="append", default=None, metavar="NAME",
                   help=f"{', '.join(_ALL)} or all; repeat or comma-separate (default: all; --quick: "
                   f"{', '.join(_QUICK)}; CPU: {', '.join(_CPU)})")
    s.add_argument("--quick", action="store_true", help="a few minutes on a GPU: smaller sizes, fewer saves, N=10 only")
    s.add_argument("--size", choices=("tiny", "quick", "full"), default=None,
                   help="size preset (default: full; quick with --quick; tiny on CPU)")
    s.add_argument("--out", default="bench-out", help="output folder (default: ./bench-out)")
    s.add_argument("--root", default=None, help="checkpoint root (default: /dev/shm/gpusnap-bench when it exists)")
    s.add_argument("--disk-root", default=None, help="root of the to-disk variants (default: a temp dir on disk)")
    s.add_argument("--steps", type=int, default=None, help="plain steps timed for the median step")
    s.add_argument("--saves", type=int, default=None, help="measured saves per system (first + warm ones)")
    s.add_argument("--every", type=_int_list, default=None, metavar="N[,N...]",
                   help="save every N steps for the throughput figure (default 1,10,100; --quick: 10)")
    s.add_argument("--systems", default=None, help="only these system keys, comma-separated (see docs/bench.md)")
    s.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when present)")
    s.add_argument("--batch", type=int, default=None, help="override the preset batch size")
    s.add_argument("--seq", type=int, default=None, help="override the preset sequence length (image size, cache length)")
    s.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new measurements after this many seconds (default with --quick on a GPU: 480; "
                   "with --cost --quick: 500)")
    s.add_argument("--no-plots", action="store_true", help="do not draw PNGs")
    cost = s.add_argument_group("cost suite (--cost)")
    cost.add_argument("--cost", action="store_true",
                      help="measure what each checkpoint costs a training job (wall and CPU seconds, durable "
                      "bandwidth, throughput at every N) for gpusnap default and fast tier, pinned copy + "
                      "writer thread, torch.save in a thread; writes OUT/cost.json and OUT/cost.md "
                      "(default workloads: llama, gpt2-large)")
    cost.add_argument("--dcp", action="store_true", help="with --cost: add DCP async_save, plain and with a pinned "
                      "stager (slow: seconds per checkpoint)")
    cost.add_argument("--window-steps", type=int, default=None, metavar="N",
                      help="with --cost: steps per window (default 60; --quick: 30; CPU: 3)")
    cost.add_argument("--fast-root", default=None,
                      help="with --cost: root of the fast tier (default: a folder under --root)")


def _workloads(values: list[str] | None, *, quick: bool, cpu: bool, cost: bool = False) -> list[str]:
    if not values:
        if cost:
            from gpusnap.bench.cost_runner import COST_WORKLOADS

            return list(COST_WORKLOADS)
        return list(_CPU if cpu else (_QUICK if quick else _ALL))
    names: list[str] = []
    for value in values:
        for name in value.split(","):
            name = name.strip()
            if name == "all":
                names += [n for n in _ALL if n not in names]
            elif name not in _ALL:
                raise ValueError(f"unknown workload {name!r}; choose from {', '.join(_ALL)} or all")
            elif name not in names:
                names.append(name)
    return names


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run, rebuilt from the parsed options."""
    words = ["gpusnap", "bench"]
    for name, value in sorted(vars(args).items()):
        if name in ("command", "func") or value in (None, False):
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list):
            joined = ",".join(str(v) for v in value)
            words += [flag, joined]
        else:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def run(args: argparse.Namespace) -> bool:
    """Runs the bench; True when every correctness check passed and no gpusnap row failed."""
    import torch

    from gpusnap.bench.report import write_report
    from gpusnap.bench.runner import (
        BenchOptions,
        default_disk_root,
        default_root,
        run_bench,
    )

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda[:i], got {args.device!r}")
    for flag in ("steps", "saves", "batch", "seq", "window_steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.cost:
        return _run_cost(args, device)
    for flag in ("dcp", "window_steps", "fast_root"):
        if getattr(args, flag) not in (None, False):
            raise ValueError(f"--{flag.replace('_', '-')} goes with --cost")
    opts = BenchOptions(
        workloads=_workloads(args.workload, quick=args.quick, cpu=device.type == "cpu"),
        device=device,
        quick=args.quick,
        out=args.out,
        root=args.root or default_root(),
        disk_root=args.disk_root or default_disk_root(args.out),
        size=args.size,
        steps=args.steps,
        saves=args.saves,
        every=args.every,
        systems=[s.strip() for s in args.systems.split(",")] if args.systems else None,
        batch=args.batch,
        seq=args.seq,
        budget_s=args.budget_s,
        plots=not args.no_plots,
        command=_command(args),
    )
    results = run_bench(opts)
    written = write_report(results, args.out, plots=opts.plots)
    print()
    for what, path in written.items():
        print(f"{what}: {os.path.relpath(path) if os.path.exists(path) else path}")
    ok = True
    for wl in results["workloads"]:
        for check in wl.get("correctness", []):
            if not check["ok"]:
                print(f"CORRECTNESS FAILED: {wl['name']} {check['system']} save {check['save']}: {check['detail']}")
                ok = False
        for row in wl.get("systems", []):
            if row["family"] == "gpusnap" and row["status"].startswith("failed"):
                print(f"FAILED: {wl['name']} {row['system']}: {row['status']}")
                ok = False
    if results.get("disclaimer"):
        print(results["disclaimer"])
    return ok


def _run_cost(args: argparse.Namespace, device: torch.device) -> bool:
    """The cost suite; True when every bit-exactness check passed and no gpusnap row failed."""
    from gpusnap.bench.cost_report import summary_table, write_cost_report
    from gpusnap.bench.cost_runner import CostOptions, run_cost
    from gpusnap.bench.runner import default_root

    opts = CostOptions(
        workloads=_workloads(args.workload, quick=args.quick, cpu=device.type == "cpu", cost=True),
        device=device,
        quick=args.quick,
        root=args.root or default_root(),
        fast_root=args.fast_root,
        size=args.size,
        window_steps=args.window_steps,
        saves=args.saves,
        every=args.every,
        systems=[s.strip() for s in args.systems.split(",")] if args.systems else None,
        dcp=args.dcp,
        batch=args.batch,
        seq=args.seq,
        budget_s=args.budget_s,
        command=_command(args),
    )
    results = run_cost(opts)
    written = write_cost_report(results, args.out)
    print()
    for what, path in written.items():
        print(f"{what}: {os.path.relpath(path)}")
    ok = True
    for wl in results["workloads"]:
        for check in wl.get("checks", []):
            if not check["ok"]:
                print(f"CORRECTNESS FAILED: {wl['name']} {check['system']} {check['save']}: {check['detail']}")
                ok = False
        for row in wl.get("systems", []):
            if row["family"] == "gpusnap" and row["status"].startswith("failed"):
                print(f"FAILED: {wl['name']} {row['system']}: {row['status']}")
                ok = False
    if results.get("disclaimer"):
        print(results["disclaimer"])
    print()
    print("\n".join(summary_table(results)))  # the short table, last
    return ok
