"""The text of ``gpusnap diff`` and ``gpusnap du``."""

from __future__ import annotations

from collections.abc import Iterator

from gpusnap.cli.diff import NH128, STATUSES, Diff
from gpusnap.cli.du import RootUsage
from gpusnap.cli.render import columns, format_time, human_bytes
from gpusnap.storage.manifest import Manifest

__all__ = ["diff_lines", "du_lines"]


def _name(m: Manifest) -> str:
    return f"{m.id} (tag {m.tag})" if m.tag else m.id


def _chunks(nbytes: int, count: int) -> str:
    return f"{human_bytes(nbytes)} in {count} chunk(s)"


def diff_lines(d: Diff, *, all_rows: bool) -> Iterator[str]:
    yield f"A: {_name(d.a)}, created {format_time(d.a.created)}"
    yield f"B: {_name(d.b)}, created {format_time(d.b.created)}"
    yield "tensors: " + ", ".join(f"{d.count(s)} {s}" for s in STATUSES)
    yield (
        f"bytes: {_chunks(d.shared_bytes, d.shared_chunks)} shared; "
        f"{_chunks(d.a_only_bytes, d.a_only_chunks)} only in A; {_chunks(d.b_only_bytes, d.b_only_chunks)} only in B"
    )
    if d.compared_by == NH128:
        yield "compared by: the fast tier's nh128 device hashes (change detection, not BLAKE2b identity)"
    else:
        yield "compared by: BLAKE2b-128 chunk digests"
    rows = [("STATUS", "KEY", "DTYPE", "SHAPE", "BYTES", "CHANGED")]
    for e in d.tensors:
        if e.status == "equal" and not all_rows:
            continue
        size = "?" if e.nbytes is None else human_bytes(e.nbytes)
        changed = "?" if e.changed_bytes is None else human_bytes(e.changed_bytes)
        key = f"{e.key} ({e.note})" if e.note else e.key
        rows.append((e.status, key, e.dtype or "-", "x".join(map(str, e.shape)) or "scalar", size, changed))
    if len(rows) > 1:
        yield ""
        yield from columns(rows, "  ")
    values = [e for e in d.values if e.status != "equal"]
    yield ""
    yield "values: " + ", ".join(f"{d.count(s, values=True)} {s}" for s in STATUSES)
    for e in values:
        yield f"  {e.status:<8} {e.key}"
    if not all_rows and d.count("equal"):
        yield ""
        yield "(--all: list the equal tensors too; --json: everything, machine readable)"


def du_lines(u: RootUsage) -> Iterator[str]:
    rows = [("ID", "TAG", "CREATED", "SIZE", "UNIQUE", "SHARED")]
    for c in u.checkpoints:
        m = c.manifest
        rows.append((m.id, m.tag or "-", format_time(m.created), human_bytes(c.logical),
                     human_bytes(c.unique), human_bytes(c.shared)))
    yield from columns(rows)
    yield ""
    logical = sum(c.logical for c in u.checkpoints)
    unique = sum(c.unique for c in u.checkpoints)
    yield (
        f"{len(u.checkpoints)} checkpoint(s), {human_bytes(logical)} of tensors, reference "
        f"{human_bytes(u.referenced)} stored: {human_bytes(unique)} unique + {human_bytes(u.shared)} shared"
    )
    if u.tier == "fast":
        yield (
            f"fast tier: {human_bytes(u.on_disk)} in {u.files} slab file(s), "
            f"{human_bytes(u.dead)} of it free for the next saves"
        )
    else:
        overhead = u.on_disk - u.stored
        yield (
            f"on disk: {human_bytes(u.on_disk)} in {u.files} pack(s): {human_bytes(u.stored)} of chunks "
            f"({human_bytes(u.dead)} dead: no checkpoint names them), {human_bytes(overhead)} of pack headers and indexes"
        )
    if u.missing:
        yield f"missing: {human_bytes(u.missing)} referenced bytes are in no pack (run `gpusnap verify`)"
