"""The ``gpusnap`` command's exit statuses: one scheme for every command (``gpusnap --help``)."""

from __future__ import annotations

__all__ = ["EPILOG", "EXIT_DAMAGE", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PIPE"]

EXIT_OK = 0
EXIT_DAMAGE = 1
"""Damage found: a checkpoint that is corrupt or cannot be read back; nothing else exits 1,
so ``gpusnap verify ROOT || alert`` alerts on damage only."""
EXIT_ERROR = 2
"""Bad arguments, a missing root or checkpoint, a permission or other I/O error."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT, as a shell reports it)."""
EXIT_PIPE = 141
"""The reader of stdout went away (``gpusnap show ROOT | head``): 128 + SIGPIPE, as a shell
reports a program killed by it, with no message."""

EPILOG = """\
exit status:
  0    success
  1    damage found: a checkpoint is corrupt or cannot be read back (verify; ls,
       show, diff and du when they meet an unreadable manifest; demo and bench
       when restored state differs)
  2    usage or any other error (bad arguments, no checkpoint root, unknown
       checkpoint, a file import/export cannot read or write, permission
       denied, other I/O errors)
  130  interrupted (Ctrl-C)
  141  stdout closed early (e.g. piped into head)

--json prints one JSON document on stdout (keys: see docs/cli.md); errors still
go to stderr as one line."""
