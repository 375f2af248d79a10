"""The ``--json`` documents of ``ls``, ``show``, ``verify``, ``diff``, ``du`` and ``gc``. Their keys are documented in
docs/cli.md and only ever gain new ones; ``"schema"`` says which document a reader holds."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Sequence
from typing import Any

from gpusnap.cli.diff import STATUSES, Diff, EntryChange
from gpusnap.cli.du import RootUsage
from gpusnap.cli.summary import summarize
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import GcReport
from gpusnap.storage.verify import VerifyReport

__all__ = ["diff_doc", "du_doc", "dumps", "gc_doc", "ls_doc", "show_doc", "verify_doc"]

SCHEMA = 1


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=False)


def _utc(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _checkpoint(m: Manifest, tier: str) -> dict[str, Any]:
    doc = {
        "id": m.id,
        "tier": tier,
        "tag": m.tag,
        "created": m.created,
        "created_utc": _utc(m.created),
        "nbytes": m.nbytes,
        "stall_s": m.stats.get("stall_s"),
        "duration_s": m.stats.get("duration_s"),
        "validation": m.stats.get("validation"),
    }
    if m.ranks:  # distributed (docs/distributed.md): rank 0's save's stats above
        rank0 = (m.stats.get("ranks") or [{}])[0]
        doc.update(stall_s=rank0.get("stall_s"), duration_s=rank0.get("duration_s"),
                   validation=rank0.get("validation"), world_size=m.world_size,
                   ranks=[{"rank": p.rank, "nbytes": p.nbytes} for p in m.ranks])
    return doc


def _unreadable(problems: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"manifest": where, "error": error} for where, error in problems]


def ls_doc(
    root: str, manifests: list[Manifest], problems: list[tuple[str, str]], tier: str = "durable"
) -> dict[str, Any]:
    return {
        "schema": f"gpusnap.ls/{SCHEMA}",
        "root": root,
        "checkpoints": [_checkpoint(m, tier) for m in manifests],
        "unreadable": _unreadable(problems),
    }


def show_doc(
    root: str, m: Manifest, problems: list[tuple[str, str]], tier: str = "durable", parts: Sequence[Manifest] = ()
) -> dict[str, Any]:
    """``parts``: a distributed checkpoint's rank manifests: storages, tensors, values, stats
    and tree are then rank 0's part's."""
    head = _checkpoint(m, tier)
    if parts:
        m = parts[0]
    tensors, values = summarize(m)
    return {
        "schema": f"gpusnap.show/{SCHEMA}",
        "root": root,
        **head,
        "chunk_size": m.chunk_size,
        "storages": [
            {"nbytes": s.nbytes, "device": s.device, "chunks": list(s.chunks)} for s in m.storages
        ],
        "tensors": [
            {
                "key": t.key,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "nbytes": t.nbytes,
                "device": t.device,
                "requires_grad": t.requires_grad,
            }
            for t in tensors
        ],
        "values": [{"key": v.key, "kind": v.kind, "text": v.text} for v in values],
        "stats": m.stats,
        "tree": m.tree,
        "unreadable": _unreadable(problems),
    }


def verify_doc(root: str, report: VerifyReport) -> dict[str, Any]:
    return {
        "schema": f"gpusnap.verify/{SCHEMA}",
        "root": root,
        "ok": report.ok,
        "checked_checkpoints": report.checked_checkpoints,
        "checked_chunks": report.checked_chunks,
        "checked_bytes": report.checked_bytes,
        "problems": list(report.problems),
    }


def _entry(e: EntryChange, tensor: bool) -> dict[str, Any]:
    if not tensor:
        return {"key": e.key, "status": e.status}
    out = {"key": e.key, "status": e.status, "dtype": e.dtype, "shape": list(e.shape), "nbytes": e.nbytes,
           "changed_bytes": e.changed_bytes}
    if e.note:
        out["note"] = e.note
    return out


def _by_status(changes: tuple[EntryChange, ...]) -> dict[str, list[str]]:
    return {s: [e.key for e in changes if e.status == s] for s in STATUSES}


def diff_doc(root: str, d: Diff, tier: str = "durable") -> dict[str, Any]:
    return {
        "schema": f"gpusnap.diff/{SCHEMA}",
        "root": root,
        "a": _checkpoint(d.a, tier),
        "b": _checkpoint(d.b, tier),
        "compared_by": d.compared_by,
        **_by_status(d.tensors),
        "tensors": [_entry(e, True) for e in d.tensors],
        "values": [_entry(e, False) for e in d.values],
        "bytes": {
            "shared": d.shared_bytes,
            "shared_chunks": d.shared_chunks,
            "a_only": d.a_only_bytes,
            "a_only_chunks": d.a_only_chunks,
            "b_only": d.b_only_bytes,
            "b_only_chunks": d.b_only_chunks,
        },
    }


def du_doc(root: str, u: RootUsage, problems: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "schema": f"gpusnap.du/{SCHEMA}",
        "root": root,
        "tier": u.tier,
        "checkpoints": [
            {**_checkpoint(c.manifest, u.tier), "logical_bytes": c.logical, "unique_bytes": c.unique,
             "shared_bytes": c.shared}
            for c in u.checkpoints
        ],
        "total": {
            "logical_bytes": sum(c.logical for c in u.checkpoints),
            "unique_bytes": sum(c.unique for c in u.checkpoints),
            "shared_bytes": u.shared,
            "referenced_bytes": u.referenced,
            "files": u.files,
            "on_disk_bytes": u.on_disk,
            "stored_bytes": u.stored,
            "dead_bytes": u.dead,
            "missing_bytes": u.missing,
        },
        "unreadable_data": list(u.unreadable),
        "unreadable": _unreadable(problems),
    }


def gc_doc(root: str, r: GcReport, tier: str = "durable") -> dict[str, Any]:
    return {
        "schema": f"gpusnap.gc/{SCHEMA}",
        "root": root,
        "tier": tier,
        "deleted_checkpoints": list(r.deleted_checkpoints),
        "deleted_packs": list(r.deleted_packs),
        "freed_bytes": r.freed_bytes,
        "compacted_packs": list(r.compacted_packs),
        "written_packs": list(r.written_packs),
        "rewritten_bytes": r.rewritten_bytes,
        "compacted_bytes": r.compacted_bytes,
        "dead_bytes": r.dead_bytes,
        "problems": list(r.problems),
        "notes": list(r.notes),
        "unreadable": [{"manifest": u.path, "error": u.reason} for u in r.unreadable],
    }
