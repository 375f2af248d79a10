"""SIGKILL of a process saving to a fast tier: while a save copies into the slabs, while it
publishes its manifest, and while a checkpoint is being promoted. A fresh process then finds
every committed checkpoint intact, both roots verify clean, and saving and promoting work.

No sleeps: the child stops itself at the chosen moment (a patched step blocks forever after
printing a line) and the parent kills it once it has read that line. The child records each
committed checkpoint in a side file when ``wait()`` returns, with its step: every value saved
is a function of the step, so the parent knows what each checkpoint must hold.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from faults import HANG_S

import gpusnap
from gpusnap.cli.main import main as cli_main
from gpusnap.storage.repository import Repository

CHILD = textwrap.dedent(
    """
    import json, sys, threading, torch, gpusnap
    from gpusnap.storage import backend, fast_tier, txn
    durable, fast, side, mode = sys.argv[1:5]
    KILL_AT = 5  # the step whose save (or promotion) is in flight when the parent kills
    cfg = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20, io_threads=2)
    w = torch.zeros(256, 1024)     # 1 MiB, every element equal to the step
    noise = torch.zeros(64, 1024)  # pseudo-random, seeded by the step
    app = {"w": w, "noise": noise, "step": 0}
    at = {"step": 0, "calls": 0}
    lock = threading.Lock()

    def stop_here(what):
        print(what, flush=True)
        threading.Event().wait()  # until SIGKILL

    def call_of_the_kill_step(k):
        with lock:
            if at["step"] != KILL_AT:
                return False
            at["calls"] += 1
            return at["calls"] == k

    def second_call_of_the_kill_step():
        return call_of_the_kill_step(2)

    take = fast_tier.FastTxn.take
    def held_take(self, n):  # mid-copy: one piece is in the slab, the next waits
        if mode == "copying" and second_call_of_the_kill_step():
            stop_here("blocked copying")
        return take(self, n)
    fast_tier.FastTxn.take = held_take

    rename = backend.LocalBackend.rename
    def held_rename(self, src, dst):  # the manifest is written to tmp/, not yet published
        if mode == "committing" and at["step"] == KILL_AT and dst.startswith("manifests/") and self.root.rstrip("/").endswith("/fast"):
            stop_here("blocked committing")
        return rename(self, src, dst)
    backend.LocalBackend.rename = held_rename

    put_run = txn.WriteTxn.put_run
    recorded = threading.Event()  # the kill step's commit is in the side file
    def held_put(self, digests, data, lengths):  # a promotion with one run in a durable pack
        written = put_run(self, digests, data, lengths)
        if mode == "promoting" and call_of_the_kill_step(1):
            recorded.wait()  # (the promotion may start before wait() returns to the main thread)
            stop_here("blocked promoting")
        return written
    txn.WriteTxn.put_run = held_put

    def record(**entry):
        with open(side, "a") as f:
            f.write(json.dumps(entry) + "\\n")

    ck = gpusnap.Checkpointer(durable, fast_root=fast, config=cfg, keep_last=2, promote_every=2)
    for step in range(1, 100):
        w.fill_(step)
        noise.copy_(torch.randn(64, 1024, generator=torch.Generator().manual_seed(step)))
        app["step"] = step
        at["step"] = step
        info = ck.save(app, promote=(mode == "promoting" and step == KILL_AT)).wait()
        record(id=info.id, step=step)
        if step == KILL_AT:
            recorded.set()
        ck.wait()  # the promotion due, if any
        if step % 2 == 0 or (mode == "promoting" and step == KILL_AT):
            record(promoted=info.id)
    """
)


def _expected(step: int) -> dict[str, torch.Tensor]:
    noise = torch.randn(64, 1024, generator=torch.Generator().manual_seed(step))
    return {"w": torch.full((256, 1024), float(step)), "noise": noise}


def _restore(ck: gpusnap.Checkpointer, checkpoint: str | None) -> dict:
    app = {"w": torch.empty(256, 1024), "noise": torch.empty(64, 1024), "step": -1}
    ck.restore(app, checkpoint)
    return app


def _bit_exact(app: dict) -> bool:
    want = _expected(app["step"])
    return all(torch.equal(app[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def _run_until_blocked(tmp_path: Path, mode: str) -> tuple[Path, Path, list[dict]]:
    durable, fast, side = tmp_path / "durable", tmp_path / "fast", tmp_path / "side.jsonl"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), str(durable), str(fast), str(side), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()  # blocks until the child is where it should be
        assert line == f"blocked {mode}", f"child said {line!r}; stderr:\n{proc.stderr.read().decode()[-3000:]}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(HANG_S)
    assert proc.returncode == -signal.SIGKILL
    records = [json.loads(line) for line in side.read_text().splitlines()]
    return durable, fast, records


@pytest.mark.parametrize("mode", ["copying", "committing"])
def test_sigkill_while_a_fast_save_is_in_flight_loses_nothing_committed(tmp_path: Path, mode: str) -> None:
    durable, fast, records = _run_until_blocked(tmp_path, mode)
    committed = [r for r in records if "step" in r]
    promoted = [r["promoted"] for r in records if "promoted" in r]
    assert [r["step"] for r in committed] == [1, 2, 3, 4]  # the 5th was in flight
    assert promoted == [committed[1]["id"], committed[3]["id"]]
    with gpusnap.Checkpointer(durable, fast_root=fast) as ck:
        listed = ck.list()
        assert [i.id for i in listed] == [r["id"] for r in committed[-3:]]  # durable keeps 2, fast 2
        latest = _restore(ck, None)
        assert latest["step"] == 4 and _bit_exact(latest)
        for r in committed[-3:]:
            app = _restore(ck, r["id"])
            assert app["step"] == r["step"] and _bit_exact(app), r
        assert cli_main(["verify", str(fast)]) == 0
        assert cli_main(["verify", str(durable)]) == 0
        app["step"] = 7
        after = ck.save(app).wait()  # the killed save's leftovers neither block nor survive the next one
        assert ck.latest().id == after.id  # type: ignore[union-attr]
        assert _restore(ck, None)["step"] == 7
    assert not list((fast / "tmp").iterdir())
    assert cli_main(["verify", str(fast)]) == 0


def test_sigkill_during_a_promotion_leaves_both_roots_clean_and_promoting_works_again(tmp_path: Path) -> None:
    durable, fast, records = _run_until_blocked(tmp_path, "promoting")
    committed = [r for r in records if "step" in r]
    promoted = [r["promoted"] for r in records if "promoted" in r]
    assert [r["step"] for r in committed] == [1, 2, 3, 4, 5]  # the 5th committed; its promotion was cut
    assert promoted == [committed[1]["id"], committed[3]["id"]]
    assert [m.id for m in Repository.open(durable).list()] == promoted  # only whole promotions
    assert cli_main(["verify", str(fast)]) == 0
    assert cli_main(["verify", str(durable)]) == 0
    with gpusnap.Checkpointer(durable, fast_root=fast, keep_last=5) as ck:
        tiers = {i.id: i.tier for i in ck.list()}
        assert tiers == {promoted[0]: "durable", promoted[1]: "durable", committed[4]["id"]: "fast"}
        app = _restore(ck, None)
        assert app["step"] == 5 and _bit_exact(app)
        app["step"] = 6
        app["w"].fill_(6)
        app["noise"].copy_(_expected(6)["noise"])
        again = ck.save(app, promote=True).wait()
        ck.wait()
        assert {i.id: i.tier for i in ck.list()}[again.id] == "durable"
    assert [m.id for m in Repository.open(durable).list()] == [*promoted, again.id]
    with gpusnap.Checkpointer(durable) as plain:
        app = _restore(plain, again.id)
    assert app["step"] == 6 and _bit_exact(app)
    assert cli_main(["verify", str(durable)]) == 0
    assert cli_main(["verify", str(fast)]) == 0
