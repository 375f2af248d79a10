"""The CLI's commands, each a function of parsed arguments returning an exit code."""

from __future__ import annotations

import argparse

from gpusnap.cli.main import EXIT_FAIL, EXIT_OK
from gpusnap.cli.progress import byte_progress
from gpusnap.cli.render import checkpoint_table, human_bytes, tree_lines
from gpusnap.storage.repository import Repository

__all__ = ["cmd_bench", "cmd_demo", "cmd_gc", "cmd_ls", "cmd_show", "cmd_verify"]


def _open(root: str) -> Repository:
    return Repository.open(root, create=False)


def _warn_problems(repo: Repository) -> None:
    for where, problem in repo.problems():
        print(f"warning: unreadable checkpoint {where}: {problem}")


def cmd_ls(args: argparse.Namespace) -> int:
    repo = _open(args.root)
    manifests = repo.list()
    _warn_problems(repo)
    if not manifests:
        print(f"no committed checkpoints in {args.root}")
        return EXIT_OK
    for line in checkpoint_table(manifests):
        print(line)
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    repo = _open(args.root)
    m = repo.resolve(args.checkpoint)
    print(f"checkpoint {m.id}" + (f" (tag {m.tag})" if m.tag else ""))
    print(f"  {len(m.storages)} storages, {human_bytes(m.nbytes)}, chunk size {human_bytes(m.chunk_size)}")
    stats = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.stats.items())
    print(f"  stats: {stats}")
    for line in tree_lines(m):
        print("  " + line)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    repo = _open(args.root)
    target = repo.resolve(args.checkpoint).id if args.checkpoint else None
    manifests = [m for m in repo.list() if target is None or m.id == target]
    total = sum(m.nbytes for m in manifests)
    with byte_progress(total, "verifying") as advance:
        report = repo.verify(target, progress=advance)
    for problem in report.problems:
        print(f"CORRUPT: {problem}")
    summary = (
        f"{report.checked_checkpoints} checkpoint(s), {report.checked_chunks} chunks, "
        f"{human_bytes(report.checked_bytes)} checked"
    )
    if report.ok:
        print(f"ok: {summary}")
        return EXIT_OK
    print(f"corrupt: {len(report.problems)} problem(s); {summary}")
    return EXIT_FAIL


def cmd_gc(args: argparse.Namespace) -> int:
    if args.keep_last is not None and args.keep_last < 1:
        raise ValueError("--keep-last must be at least 1")
    repo = _open(args.root)
    report = repo.gc(args.keep_last)
    if report.skipped:
        print(f"gc skipped: {report.notes}")
        return EXIT_FAIL
    print(
        f"deleted {len(report.deleted_checkpoints)} checkpoint(s) and "
        f"{len(report.deleted_packs)} pack(s), freed {human_bytes(report.freed_bytes)}"
    )
    for note in report.notes:
        print(f"note: {note}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from gpusnap.cli.demo import run_demo

    return EXIT_OK if run_demo(args.root, steps=args.steps, every=args.every, device=args.device) else EXIT_FAIL


def cmd_bench(args: argparse.Namespace) -> int:
    from gpusnap.cli.bench import run

    return EXIT_OK if run(args) else EXIT_FAIL
