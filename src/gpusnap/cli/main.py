"""Entry point of the ``gpusnap`` command. Errors print one line on stderr, never a traceback
(except for a bug in gpusnap itself); exit statuses follow :mod:`gpusnap.cli.exits`."""

from __future__ import annotations

import argparse
import os
import select
import sys
import traceback
from collections.abc import Sequence

import gpusnap
from gpusnap.cli.bench import add_parser as add_bench_parser
from gpusnap.cli.serve import add_parser as add_serve_parser
from gpusnap.cli.exits import EPILOG, EXIT_DAMAGE, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_PIPE
from gpusnap.cli.interop_cmds import add_parsers as add_interop_parsers
from gpusnap.errors import CheckpointError, IntegrityError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpusnap",
        description="Checkpoint and restore the GPU and CPU state of a running PyTorch program.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"gpusnap {gpusnap.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    as_json = {"action": "store_true", "dest": "json", "help": "print one JSON document (docs/cli.md)"}

    s = sub.add_parser("ls", help="list committed checkpoints (exit 1 if a manifest is unreadable)")
    s.add_argument("root", help="checkpoint root (directory or fsspec URL)")
    s.add_argument("--json", **as_json)

    s = sub.add_parser("show", help="summarize one checkpoint: tensors, values, key stats")
    s.add_argument("root")
    s.add_argument("checkpoint", nargs="?", help="id or tag (default: latest)")
    s.add_argument("--stats", action="store_true", help="list every stat the save recorded")
    s.add_argument("--json", **as_json)

    s = sub.add_parser("verify", help="re-hash every stored byte (exit 1 on corruption)")
    s.add_argument("root")
    s.add_argument("checkpoint", nargs="?", help="id or tag (default: every checkpoint)")
    s.add_argument("--json", **as_json)

    s = sub.add_parser("diff", help="which tensors changed between two checkpoints, and the bytes they share")
    s.add_argument("root")
    s.add_argument("a", metavar="A", help="id or tag of the first checkpoint")
    s.add_argument("b", metavar="B", help="id or tag of the second checkpoint")
    s.add_argument("--all", action="store_true", help="list the equal tensors too")
    s.add_argument("--json", **as_json)

    s = sub.add_parser("du", help="bytes per checkpoint (unique and shared) and on disk")
    s.add_argument("root")
    s.add_argument("--json", **as_json)

    s = sub.add_parser("gc", help="delete old checkpoints and unreferenced data")
    s.add_argument("root")
    s.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep the N newest")
    s.add_argument("--no-compact", action="store_false", dest="compact",
                   help="keep partly live packs as they are (default: rewrite the live chunks of mostly dead ones)")
    s.add_argument("--compact-percent", type=int, default=None, metavar="P",
                   help="compact packs more than P%% dead (default: Config.gc_compact_percent, 50)")
    s.add_argument("--json", **as_json)

    s = sub.add_parser("demo", help="train a small model, checkpoint it concurrently, restore, compare")
    s.add_argument("--root", default=None, help="where to write checkpoints (default: a temp dir)")
    s.add_argument("--steps", type=int, default=60)
    s.add_argument("--every", type=int, default=10, help="save every N steps")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")

    add_bench_parser(sub)
    add_interop_parsers(sub)
    add_serve_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (usage errors and ``--version`` included)."""
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit as exc:  # argparse: --help/--version (0) or a usage error (2)
            sys.stdout.flush()
            return exc.code if isinstance(exc.code, int) else EXIT_ERROR
        from gpusnap.cli import commands

        code = int(getattr(commands, f"cmd_{args.command}")(args))
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError as exc:
        if not _stdout_gone():
            _error(exc)  # a pipe or socket of the storage, not our reader
            return EXIT_ERROR
        _drop_stdout()
        return EXIT_PIPE
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except IntegrityError as exc:
        _error(exc)
        return EXIT_DAMAGE
    except (CheckpointError, OSError, ValueError) as exc:
        _error(exc)
        return EXIT_ERROR
    except Exception:  # a bug in gpusnap: the traceback is what a report needs
        traceback.print_exc()
        _error("internal error (the traceback above is a bug in gpusnap; please report it)")
        return EXIT_ERROR


def _stdout_gone() -> bool:
    """Whether stdout's reader has closed its end (the pipe's write end polls POLLERR)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False  # not a real file (tests capture it), so it cannot be a closed pipe
    if not hasattr(select, "poll"):
        return True  # no poll (Windows): stdout is the likely pipe
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _drop_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush of what is still
    buffered cannot raise again (the Python docs' recipe for SIGPIPE)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (tests capture it)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _error_line(exc: object) -> str:
    """``exc`` as the one line the CLI prints (whitespace folded)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _error(exc: object) -> None:
    print(f"gpusnap: error: {_error_line(exc)}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
