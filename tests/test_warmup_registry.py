"""The kernel warm-ups' registry (``capture/warmup.py``): a warm-up whose thread cannot start
leaves no entry behind, so ``loading()`` does not stay true (which would send every later
snapshot through torch's copies and make every wait for the kernels fail). CUDA is faked:
only the registry is under test."""

from __future__ import annotations

import threading

import pytest
import torch

from gpusnap.capture import warmup


class _NoStart(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


class _Threading:
    """``warmup``'s view of :mod:`threading`, whose threads cannot start."""

    Thread = _NoStart

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(threading, name)


def test_a_warm_up_that_cannot_start_leaves_nothing_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(warmup, "threading", _Threading())
    device = torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        warmup.start_capture_warmup(12345, lambda d: None)
    assert not warmup.loading(device)
    assert warmup.wait_loaded([device]) == 0.0
