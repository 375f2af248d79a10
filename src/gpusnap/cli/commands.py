"""The CLI's commands, each a function of parsed arguments returning an exit status
(:mod:`gpusnap.cli.exits`). Results go to stdout; warnings and errors to stderr."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace

from gpusnap.cli.as_json import diff_doc, du_doc, dumps, gc_doc, ls_doc, show_doc, verify_doc
from gpusnap.cli.exits import EXIT_DAMAGE, EXIT_ERROR, EXIT_OK
from gpusnap.cli.opening import open_root
from gpusnap.cli.progress import sized_progress, told_progress
from gpusnap.cli.render import checkpoint_table, human_bytes, manifest_reason, unreadable_lines
from gpusnap.cli.show_text import show_lines
from gpusnap.cli.gc_text import gc_lines
from gpusnap.cli.usage_text import diff_lines, du_lines
from gpusnap.errors import CheckpointNotFoundError
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.ranks import RankedRepository, collect_ranks, whole
from gpusnap.storage.repository import GcReport, Repository, merge_reports

__all__ = ["cmd_bench", "cmd_demo", "cmd_diff", "cmd_du", "cmd_export", "cmd_gc", "cmd_import", "cmd_ls", "cmd_serve",
           "cmd_show", "cmd_verify"]


def _warn_unreadable(problems: list[tuple[str, str]], root: str, what: str) -> None:
    if problems:
        print(
            f"gpusnap: warning: {len(problems)} checkpoint manifest(s) in {root} cannot be read; "
            f"{what} (run `gpusnap verify {root}`; delete the file to drop that checkpoint)",
            file=sys.stderr,
        )


def _tier(repo: Repository) -> str:
    """``"fast"`` for a fast tier's root (``Checkpointer(fast_root=...)``), else ``"durable"``."""
    return "fast" if isinstance(repo, FastTier) else "durable"


def cmd_ls(args: argparse.Namespace) -> int:
    repo = open_root(args.root)
    manifests = repo.list()
    problems = repo.problems()
    if args.json:
        print(dumps(ls_doc(repo.root, manifests, problems, _tier(repo))))
    elif manifests:
        for line in checkpoint_table(manifests, _tier(repo)):
            print(line)
    elif not problems:
        print(f"no committed checkpoints in {args.root}")
    if not args.json:
        for line in unreadable_lines(problems):
            print(line)
    _warn_unreadable(problems, args.root, "restore() and `latest` skip them")
    return EXIT_DAMAGE if problems else EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    repo = open_root(args.root)
    ref = args.checkpoint
    problems = repo.problems()
    named = _named(problems, ref)
    if named:  # the checkpoint asked for exists but cannot be read
        return _report_unreadable(named)
    try:
        m = repo.resolve(ref)
    except CheckpointNotFoundError:
        if ref is None and problems:  # no readable checkpoint, but damaged ones
            return _report_unreadable(problems)
        raise
    parts = repo.rank_manifests(m) if isinstance(repo, RankedRepository) and m.ranks else []
    if args.json:
        print(dumps(show_doc(repo.root, m, problems, _tier(repo), parts=parts)))
    else:
        for line in show_lines(m, all_stats=args.stats, tier=_tier(repo), parts=parts):
            print(line)
    if ref is None:
        _warn_unreadable(problems, args.root, "the newest readable checkpoint is shown")
    elif ref != m.id:
        _warn_unreadable(problems, args.root, f"tag {ref!r} was looked up among the readable ones only")
    else:
        _warn_unreadable(problems, args.root, "`latest` and restore() skip them")
    return EXIT_OK


def _named(problems: list[tuple[str, str]], *refs: str | None) -> list[tuple[str, str]]:
    """The unreadable manifests of the checkpoint ids in ``refs``."""
    return [p for p in problems if _file_id(p[0]) in refs]


def _file_id(where: str) -> str:
    """The checkpoint id of a manifest's location (path or URL)."""
    name = where.replace("\\", "/").rsplit("/", 1)[-1]
    return name[: -len(".json")] if name.endswith(".json") else name


def _report_unreadable(problems: list[tuple[str, str]]) -> int:
    for where, error in problems:
        reason = manifest_reason(where, error)
        print(f"gpusnap: error: unreadable checkpoint manifest {where}: {reason}", file=sys.stderr)
    return EXIT_DAMAGE


def cmd_verify(args: argparse.Namespace) -> int:
    repo = open_root(args.root)
    ref = args.checkpoint
    with nullcontext((None, None)) if args.json else told_progress("verifying") as (on_total, advance):
        # an id whose manifest is unreadable is a problem in the report (exit 1), not unknown
        report = repo.verify(ref, progress=advance, on_total=on_total)
    if args.json:
        print(dumps(verify_doc(repo.root, report)))
        return EXIT_OK if report.ok else EXIT_DAMAGE
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
    return EXIT_DAMAGE


def cmd_diff(args: argparse.Namespace) -> int:
    from gpusnap.cli.diff import diff_manifests

    repo = open_root(args.root)
    problems = repo.problems()
    named = _named(problems, args.a, args.b)
    if named:  # a checkpoint asked for exists but cannot be read
        return _report_unreadable(named)
    d = diff_manifests(_whole(repo, repo.resolve(args.a)), _whole(repo, repo.resolve(args.b)))
    if args.json:
        print(dumps(diff_doc(repo.root, d, _tier(repo))))
    else:
        for line in diff_lines(d, all_rows=args.all):
            print(line)
    if args.a not in (d.a.id, d.b.id) or args.b not in (d.a.id, d.b.id):
        _warn_unreadable(problems, args.root, "tags were looked up among the readable ones only")
    return EXIT_OK


def cmd_du(args: argparse.Namespace) -> int:
    from gpusnap.cli.du import usage
    from gpusnap.config import Config
    from gpusnap.save.memory_tier import memory_tier_usage

    repo = open_root(args.root)
    manifests = [_whole(repo, m) for m in repo.list()]
    problems = repo.problems()
    u = usage(repo, manifests)
    memory = None if u.tier == "fast" else memory_tier_usage(args.root, Config.from_env())
    if args.json:
        doc = du_doc(repo.root, u, problems)
        doc["memory_tier"] = None if memory is None else {"path": memory[0], "host_bytes": memory[1]}
        print(dumps(doc))
    else:
        for line in du_lines(u):
            print(line)
        if memory is not None:  # (the default path's host memory for this root, held until close())
            print(f"memory tier {memory[0]}: {human_bytes(memory[1])} of host memory")
        for line in unreadable_lines(problems):
            print(line)
    for error in u.unreadable:
        print(f"gpusnap: warning: {error}; its bytes are counted on disk only", file=sys.stderr)
    _warn_unreadable(problems, args.root, "the bytes only they name count as dead")
    return EXIT_DAMAGE if problems or u.unreadable else EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    if args.keep_last is not None and args.keep_last < 1:
        raise ValueError("--keep-last must be at least 1")
    repo = open_root(args.root)
    if args.compact_percent is not None:  # (Config checks the range; the ranks' roots share it)
        repo.config = dataclasses.replace(repo.config, gc_compact_percent=args.compact_percent)
    with nullcontext(None) if args.json else sized_progress("compacting") as progress:
        report = _gc_all(repo, args, progress)
    if report.skipped:
        print(f"gpusnap: error: gc skipped: {'; '.join(report.notes)}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(dumps(gc_doc(repo.root, report, _tier(repo))))
    else:
        for line in gc_lines(report, fast=isinstance(repo, FastTier)):
            print(line)
    return EXIT_DAMAGE if report.problems else EXIT_OK


def _gc_all(
    repo: Repository, args: argparse.Namespace, progress: Callable[[int], Callable[[int], None]] | None
) -> GcReport:
    """The root's gc and then, for a distributed root, every rank's root's."""
    report = repo.gc(args.keep_last, compact=args.compact, progress=progress)
    if report.skipped or not isinstance(repo, RankedRepository):
        return report
    # every rank's root: parts and packs no checkpoint needs now
    ranks = collect_ranks(repo, compact=args.compact, progress=progress)
    return replace(merge_reports([report, replace(ranks, deleted_checkpoints=())]),
                   deleted_checkpoints=report.deleted_checkpoints)


def _whole(repo: Repository, m: Manifest) -> Manifest:
    """A distributed checkpoint with every rank's storages (for du and diff)."""
    return whole(repo, m) if isinstance(repo, RankedRepository) and m.ranks else m


def cmd_demo(args: argparse.Namespace) -> int:
    from gpusnap.cli.demo import run_demo

    return EXIT_OK if run_demo(args.root, steps=args.steps, every=args.every, device=args.device) else EXIT_DAMAGE


def cmd_serve(args: argparse.Namespace) -> int:
    from gpusnap.cli.serve import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from gpusnap.cli.bench import run

    return EXIT_OK if run(args) else EXIT_DAMAGE


def cmd_export(args: argparse.Namespace) -> int:
    from gpusnap.cli.interop_cmds import run_export

    named = _named(open_root(args.root).problems(), args.checkpoint)
    if named:  # the checkpoint asked for exists but cannot be read
        return _report_unreadable(named)
    return run_export(args)


def cmd_import(args: argparse.Namespace) -> int:
    from gpusnap.cli.interop_cmds import run_import

    return run_import(args)
