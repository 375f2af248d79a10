"""What a restore plan rebuilds at ``finish``: one slot per paired node of the checkpoint
tree, whose ``build()`` puts plain values back, refills live containers in place and calls
``load_state_dict`` on modules with extra state and on Stateful values.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import MutableMapping, MutableSequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from ..errors import CheckpointError
from .plain import type_name

__all__ = ["DictSlot", "ListSlot", "ModuleSlot", "Refill", "Slot", "StatefulSlot", "TupleSlot", "Value"]


class Slot(Protocol):
    """A paired node; ``build()`` (at finish) applies side effects and returns the restored value."""

    def build(self) -> Any: ...


@dataclass
class Value:
    value: Any

    def build(self) -> Any:
        return self.value


@dataclass
class Refill:
    """A live dict/list of plain values: its contents become ``value``, its identity stays."""

    live: Any
    value: Any

    def build(self) -> Any:
        if isinstance(self.live, MutableMapping):
            self.live.clear()
            self.live.update(self.value)
        else:
            self.live[:] = self.value
        return self.live


@dataclass
class DictSlot:
    """``live`` is updated in place when given (app_state), else a new dict is built."""

    live: MutableMapping[Any, Any] | None
    items: list[tuple[Any, Slot]]

    def build(self) -> Any:
        if self.live is None:
            return {key: slot.build() for key, slot in self.items}
        for key, slot in self.items:
            value = slot.build()
            if self.live[key] is not value:
                self.live[key] = value
        return self.live


@dataclass
class ListSlot:
    live: MutableSequence[Any] | None
    items: list[Slot]

    def build(self) -> Any:
        if self.live is None:
            return [slot.build() for slot in self.items]
        for i, slot in enumerate(self.items):
            value = slot.build()
            if self.live[i] is not value:
                self.live[i] = value
        return self.live


@dataclass
class TupleSlot:
    live: tuple[Any, ...] | None
    items: list[Slot]

    def build(self) -> Any:
        values = tuple(slot.build() for slot in self.items)
        live = self.live
        if live is not None and len(live) == len(values) and all(a is b for a, b in zip(live, values)):
            return live
        return values


@dataclass
class ModuleSlot:
    module: nn.Module
    path: str
    extra: list[tuple[str, Slot]]
    metadata: Any

    def build(self) -> Any:
        if self.extra:
            state: OrderedDict[str, Any] = OrderedDict((key, slot.build()) for key, slot in self.extra)
            if self.metadata is not None:
                state._metadata = self.metadata  # type: ignore[attr-defined]  # version info for _load_from_state_dict
            # strict=False: the tensors are absent on purpose, they were restored in place.
            _load(self.module, state, self.path, strict=False)
        return self.module


@dataclass
class StatefulSlot:
    obj: Any
    path: str
    state: Slot

    def build(self) -> Any:
        _load(self.obj, self.state.build(), self.path)
        return self.obj


def _load(obj: Any, state: Any, path: str, **kwargs: Any) -> None:
    try:
        obj.load_state_dict(state, **kwargs)
    except Exception as exc:
        raise CheckpointError(f"{path or '<root>'}: {type_name(obj)}.load_state_dict() failed: {exc!r}") from exc
