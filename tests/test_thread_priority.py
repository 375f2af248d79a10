"""Background threads (promotion, slab preparation) run at the lowest CPU priority; the
program's threads keep theirs."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from fast_support import CFG, make_state, roots, train

import gpusnap
import gpusnap.storage.promote as promote_module
from gpusnap.thread_priority import LOWEST, lower_this_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")


def _priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_only_the_calling_thread_is_lowered() -> None:
    before = _priority()
    seen: list[tuple[bool, int]] = []
    t = threading.Thread(target=lambda: seen.append((lower_this_thread(), _priority())))
    t.start()
    t.join()
    assert seen == [(True, LOWEST)]
    assert _priority() == before  # (the caller's own priority is untouched)


def test_promotion_writes_and_slab_preparation_run_at_the_lowest_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed_at: set[int] = set()
    real_name = promote_module.device_name

    def name(device_hash: str) -> str:  # runs on the promotion's pool threads, before each write
        hashed_at.add(_priority())
        return real_name(device_hash)

    monkeypatch.setattr(promote_module, "device_name", name)
    before = _priority()
    durable, fast = roots(tmp_path)
    state = make_state(0)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        train(state, 1)
        ck.save(state, promote=True).wait()
        ck.wait()  # the promotion done
        tier = ck._tiers.fast()
        assert tier is not None
        tier._preparer.join()
        prepared_at: list[int] = []
        tier._preparer._prepare = lambda slab: prepared_at.append(_priority())
        tier._preparer.want([999])
        tier._preparer.join()
    assert hashed_at == {LOWEST}
    assert prepared_at == [LOWEST]
    assert _priority() == before
