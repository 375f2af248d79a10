"""What an export wrote, and what its format made it leave out or write differently."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ExportReport", "Written"]


@dataclass(frozen=True)
class Written:
    """A format writer's account: ``skipped`` names the plain values it cannot hold (not
    written); ``copies`` the tensors it wrote as copies of their own, as ``(name, shared
    with)``, because the format cannot store two tensors on one storage."""

    skipped: tuple[str, ...] = ()
    copies: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ExportReport:
    """The result of :func:`gpusnap.export`: ``path`` written in ``format`` from checkpoint
    ``checkpoint`` (its id), ``tensors`` tensors of ``nbytes`` bytes and ``values`` plain
    values under their dotted names, plus what the format could not keep (see :class:`Written`)."""

    path: str
    format: str
    checkpoint: str
    tensors: int
    nbytes: int
    values: int
    skipped: tuple[str, ...] = ()
    copies: tuple[tuple[str, str], ...] = ()

    def notes(self) -> list[str]:
        """One line for each thing the format did not keep as it was (empty when it kept all)."""
        out = []
        if self.skipped:
            out.append(f"{len(self.skipped)} plain value(s) not written ({self.format} holds tensors only): "
                       f"{_some(self.skipped)}")
        if self.copies:
            pairs = [f"{name} (shared with {other})" for name, other in self.copies]
            out.append(f"{len(self.copies)} tensor(s) written as copies of their own, not sharing storage "
                       f"({self.format} cannot share; they load as distinct tensors): {_some(pairs)}")
        return out


def _some(names: tuple[str, ...] | list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")
