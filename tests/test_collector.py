"""save() holds Python's cyclic collector off on the program's thread (collector.py)."""

from __future__ import annotations

import gc
import sys
import threading
from typing import Any

import pytest
import torch

import gpusnap


def _config() -> gpusnap.Config:
    return gpusnap.Config(chunk_size=1 << 12, staging_bytes=1 << 16, fsync=False, io_threads=2)


@pytest.fixture
def eager_collector():
    """A collector that would run at almost every allocation."""
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*old)


@pytest.mark.parametrize("blocking", [False, True])
def test_no_collection_inside_save_on_the_callers_thread(tmp_path: Any,
                                                         eager_collector: None, blocking: bool) -> None:
    caller = threading.get_ident()
    during: list[int] = []

    def inside_save_work() -> bool:
        """Whether the collection was triggered inside save()'s work on the caller's thread
        (the frames of gpusnap's save path below ``Checkpointer.save``)."""
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_save_now" and frame.f_code.co_filename.endswith("saves.py"):
                return True
            frame = frame.f_back
        return False

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and threading.get_ident() == caller and inside_save_work():
            during.append(info["generation"])

    state = {f"t{i}": torch.randn(64) for i in range(200)} | {"step": 3, "cfg": {"lr": [0.1] * 50}}
    gc.callbacks.append(on_gc)
    try:
        with gpusnap.Checkpointer(tmp_path / "ck", config=_config()) as ck:
            for _ in range(3):
                ck.save(state, blocking=blocking).wait()
            assert gc.isenabled()
            gc.collect()  # the callback sees collections at all (else the test proves nothing)
    finally:
        gc.callbacks.remove(on_gc)
    assert during == [], f"collections inside save() on the caller's thread: {during}"


def test_a_disabled_collector_stays_disabled(tmp_path: Any) -> None:
    gc.disable()
    try:
        with gpusnap.Checkpointer(tmp_path / "ck", config=_config()) as ck:
            ck.save({"t": torch.randn(8)}).wait()
            assert not gc.isenabled()
    finally:
        gc.enable()
