"""No code from a checkpoint runs unless the user opts in (DESIGN.md invariant 6)."""

from __future__ import annotations

import base64
import fractions
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from gpusnap.errors import CheckpointError
from gpusnap.state import SpanInfo, decode_plain, flatten, plan_restore
from gpusnap.restore.apply_bytes import apply_all


class _WritesMarker:
    """Unpickling this calls os.system: it would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def evil_node(marker: Path) -> dict[str, str]:
    payload = pickle.dumps(_WritesMarker(marker))
    return {"t": "pickle", "v": base64.b64encode(payload).decode("ascii")}


def test_decode_refuses_pickle_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(CheckpointError, match="allow_pickle"):
        decode_plain({"t": "list", "items": [evil_node(marker)]}, "opts", False)
    assert not marker.exists()


def test_plan_restore_refuses_pickle_before_writing_anything(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    weight = torch.arange(4.0)
    app_state = {"w": weight, "extra": None}
    flat = flatten(app_state)
    tree = json.loads(json.dumps(flat.tree))
    tree["items"][1][1] = evil_node(marker)  # a tampered manifest
    with pytest.raises(CheckpointError) as err:
        plan_restore(app_state, tree, [SpanInfo(s.nbytes, str(s.device)) for s in flat.spans])
    assert "extra" in str(err.value)
    assert not marker.exists()
    assert app_state["extra"] is None


def test_the_marker_payload_really_runs_when_unpickled(tmp_path: Path) -> None:
    """Guards the two tests above: the payload is live, so 'not created' means 'refused'."""
    marker = tmp_path / "pwned"
    decode_plain(evil_node(marker), "opts", True)
    assert marker.exists()


def test_unpicklable_value_needs_opt_in_on_both_sides() -> None:
    app_state = {"ratio": fractions.Fraction(2, 3)}
    with pytest.raises(CheckpointError, match="ratio.*Fraction"):
        flatten(app_state)
    flat = flatten(app_state, allow_pickle=True)
    app_state["ratio"] = fractions.Fraction(0)
    with pytest.raises(CheckpointError, match="allow_pickle"):
        plan_restore(app_state, flat.tree, [])
    apply_all(plan_restore(app_state, flat.tree, [], allow_pickle=True), {})
    assert app_state["ratio"] == fractions.Fraction(2, 3)
