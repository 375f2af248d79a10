"""Entry point of the ``gpusnap`` command. Errors print one line on stderr, never a traceback.

Exit codes: 0 success; 1 failure (``verify``: corruption found); 2 usage (bad arguments,
missing root, unknown checkpoint).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpusnap.cli.bench import add_parser as add_bench_parser
from gpusnap.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpusnap",
        description="Checkpoint and restore the GPU and CPU state of a running PyTorch program.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("ls", help="list committed checkpoints")
    s.add_argument("root", help="checkpoint root (directory or fsspec URL)")

    s = sub.add_parser("show", help="show the tensors and values of a checkpoint")
    s.add_argument("root")
    s.add_argument("checkpoint", nargs="?", help="id or tag (default: latest)")

    s = sub.add_parser("verify", help="re-hash every stored byte (exit 1 on corruption)")
    s.add_argument("root")
    s.add_argument("checkpoint", nargs="?", help="id or tag (default: every checkpoint)")

    s = sub.add_parser("gc", help="delete old checkpoints and unreferenced data")
    s.add_argument("root")
    s.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep the N newest")

    s = sub.add_parser("demo", help="train a small model, checkpoint it concurrently, restore, compare")
    s.add_argument("--root", default=None, help="where to write checkpoints (default: a temp dir)")
    s.add_argument("--steps", type=int, default=60)
    s.add_argument("--every", type=int, default=10, help="save every N steps")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")

    add_bench_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from gpusnap.cli import commands

    handler = getattr(commands, f"cmd_{args.command}")
    try:
        return int(handler(args))
    except CheckpointNotFoundError as exc:
        _error(exc)
        return EXIT_USAGE
    except (CheckpointError, OSError, ValueError) as exc:
        _error(exc)
        return EXIT_FAIL
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


def _error(exc: object) -> None:
    text = " ".join(str(exc).split()) or type(exc).__name__
    print(f"gpusnap: error: {text}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
