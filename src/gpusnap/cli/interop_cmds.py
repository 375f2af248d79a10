"""``gpusnap export`` and ``gpusnap import`` (docs/interop.md): thin wrappers of
:func:`gpusnap.export` and :func:`gpusnap.import_`. A file that cannot be imported or
written, and a checkpoint export finds corrupt, is one error line naming it (exit 2, as issue
24 asks of import and export alike: the command failed on its input); nothing is left half-written."""

from __future__ import annotations

import argparse
import json
import sys

from typing import TYPE_CHECKING

from gpusnap.cli.exits import EXIT_ERROR, EXIT_OK
from gpusnap.cli.progress import sized_progress
from gpusnap.cli.render import human_bytes
from gpusnap.errors import IntegrityError

if TYPE_CHECKING:
    from gpusnap.restore.key_select import Selector

__all__ = ["EXPORT_FORMATS", "add_parsers", "run_export", "run_import"]

# gpusnap.interop.exporter.FORMATS, spelled out so that building the parser (``gpusnap --help``)
# imports no torch; a test keeps the two equal
EXPORT_FORMATS = ("safetensors", "torch", "dcp")


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("export", help="write a checkpoint as a safetensors file, a torch.save file or a DCP directory")
    s.add_argument("root")
    s.add_argument("checkpoint", nargs="?", help="id or tag (default: latest)")
    s.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    s.add_argument("-o", "--output", required=True, metavar="PATH", help="file (directory for dcp) to write")
    s.add_argument("--keys", nargs="+", metavar="K", help="entries to export: dotted key paths (model, optim.state) "
                   "or JSON lists of keys ('[\"n\", 1]': the int key 1)")
    s.add_argument("--full-names", action="store_true", help="names from the top even when --keys selects one "
                   "entry (by default --keys model gives model's own state_dict names)")
    s.add_argument("--force", action="store_true", help="replace PATH if it exists")

    s = sub.add_parser("import", help="commit a safetensors/torch.save file, a DCP or Hugging Face directory "
                       "as one checkpoint")
    s.add_argument("path", help="safetensors file, Hugging Face model directory, DCP directory or torch.save file")
    s.add_argument("root", help="checkpoint root to commit to (created if missing)")
    s.add_argument("--key", metavar="K", help="put everything under this top-level key (e.g. model)")
    s.add_argument("--tag", help="tag of the new checkpoint")


def _selector(text: str) -> Selector:
    """A ``--keys`` item: a JSON list is a tuple of keys, anything else a dotted string."""
    if text.startswith("["):
        try:
            parts = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--keys {text!r}: not a JSON list of keys: {exc}") from exc
        if not isinstance(parts, list):
            raise ValueError(f"--keys {text!r}: not a JSON list of keys")
        return tuple(parts)
    return text


def run_export(args: argparse.Namespace) -> int:
    from gpusnap.interop.exporter import export

    keys = None if args.keys is None else [_selector(k) for k in args.keys]
    try:
        with sized_progress("exporting") as progress:  # (a bar on a terminal only)
            report = export(args.root, args.output, format=args.format, checkpoint=args.checkpoint, keys=keys,
                            full_names=args.full_names, overwrite=args.force, progress=progress)
    except IntegrityError as exc:  # (its message names the chunk's file and tensor)
        print(f"gpusnap: error: export to {args.output} failed, nothing written: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return EXIT_ERROR
    print(
        f"exported checkpoint {report.checkpoint} to {report.path} ({report.format}): {report.tensors} tensor(s), "
        f"{human_bytes(report.nbytes)}; {report.values} plain value(s)"
    )
    for note in report.notes():
        print(f"gpusnap: warning: {report.path}: {note}", file=sys.stderr)
    return EXIT_OK


def run_import(args: argparse.Namespace) -> int:
    from gpusnap.interop.detect import identify
    from gpusnap.interop.importer import import_

    kind = identify(args.path)
    with sized_progress("importing") as progress:
        info = import_(args.path, args.root, key=args.key, tag=args.tag, progress=progress)
    under = f", under key {args.key!r}" if args.key else ""
    tag = f" (tag {info.tag})" if info.tag else ""
    print(f"imported {args.path} ({kind}) into {args.root} as checkpoint {info.id}{tag}: "
          f"{human_bytes(info.nbytes)} of tensors{under}")
    return EXIT_OK
