"""Live migration (gpusnap.migrate): a running program's state moves to another process
(or another app_state) in rounds while it runs, and the moved program goes on exactly as
the unmoved one would have.

A training run resumes bit-exactly in a new process; a generating model continues with
the tokens an unmoved run produces (eager and lazy); rounds after the first move only the
chunks that changed; the transport is private, pruned while the source runs and removed
after the receive. Faults are in test_migrate_faults.py, bad input in
test_migrate_inputs.py. No sleeps: the target wakes on the source's bell, and tests wait
on events (``on_round``) or on ``precopy(wait=True)``.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from gpusnap.config import Config
from gpusnap.migrate import AppliedRound, MigrationError, Source, Target
from gpusnap.storage.repository import Repository

CFG = Config(chunk_size=4096, io_threads=2)  # small chunks: a few KB of state spans many of them
HANG_S = 120.0  # only a hang guard

# The training run both processes build (the parent execs it too): dropout and data draw
# from the global RNG, which moves with the state (RNGState).
TRAIN = textwrap.dedent(
    """
    import torch, gpusnap

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 32))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return {"model": model, "optim": optim, "rng": gpusnap.RNGState(), "step": 0}

    def train_step(app):
        x = torch.randn(16, 32)
        loss = (app["model"](x) - x).pow(2).mean()
        loss.backward()
        app["optim"].step()
        app["optim"].zero_grad()
        app["step"] += 1

    def snapshot(app):
        return {"model": app["model"].state_dict(), "optim": app["optim"].state_dict(), "step": app["step"],
                "rng": torch.get_rng_state()}
    """
)

TARGET_CHILD = TRAIN + textwrap.dedent(
    """
    import sys
    from gpusnap.migrate import Target
    address, out, more = sys.argv[1], sys.argv[2], int(sys.argv[3])
    app = build(seed=1)          # another initialisation: every byte must come from the source
    train_step(app)              # (the optimizer's state exists, as in a process that trained)
    with Target(address) as dst:
        info = dst.receive(app)
    for _ in range(more):
        train_step(app)
    torch.save({"state": snapshot(app), "rounds": [r.seq for r in info.rounds],
                "moved": [r.bytes_moved for r in info.rounds], "total": info.rounds[-1].bytes_total}, out)
    """
)


def _train_ns() -> dict[str, Any]:
    ns: dict[str, Any] = {}
    exec(TRAIN, ns)
    return ns


def _equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested state (tensors compared as bytes)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.view(torch.uint8) if a.dtype == torch.bool else a, b.view(torch.uint8) if b.dtype == torch.bool else b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


class Applied:
    """The rounds a target applied (its ``on_round``); tests wait for one by its seq."""

    def __init__(self) -> None:
        self.rounds: list[AppliedRound] = []
        self._cond = threading.Condition()

    def __call__(self, applied: AppliedRound) -> None:
        with self._cond:
            self.rounds.append(applied)
            self._cond.notify_all()

    def wait_for(self, seq: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: any(r.seq >= seq for r in self.rounds), HANG_S), f"round {seq}"


def _receive_in_thread(dst: Target, app: dict[str, Any], then: Any = None) -> tuple[threading.Thread, dict[str, Any]]:
    """``dst.receive(app)`` on a thread (then ``then()`` there); the outcome in the dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["info"] = dst.receive(app)
            if then is not None:
                out["then"] = then()
        except BaseException as exc:  # (asserted by the test)
            out["error"] = exc

    thread = threading.Thread(target=run, name="test-target")
    thread.start()
    return thread, out


def _join(thread: threading.Thread, out: dict[str, Any]) -> Any:
    thread.join(HANG_S)
    assert not thread.is_alive(), "the target hangs"
    if "error" in out:
        raise out["error"]
    return out["info"]


# -- a training run ------------------------------------------------------------------------------
def test_a_training_run_migrates_to_another_process_and_resumes_bit_exactly(tmp_path: Path) -> None:
    ns = _train_ns()
    app = ns["build"](seed=0)
    ns["train_step"](app)
    script = tmp_path / "target.py"
    script.write_text(TARGET_CHILD)
    out = tmp_path / "moved.pt"
    more = 3
    with Source(app, config=CFG) as src:
        child = subprocess.Popen([sys.executable, str(script), src.address, str(out), str(more)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            for _ in range(4):  # training goes on; a round between steps
                ns["train_step"](app)
                src.precopy(wait=True)
            ns["train_step"](app)  # a step the last precopy round did not see
            handed = src.handoff()
            for _ in range(more):  # the unmoved run (the same process goes on, for comparison)
                ns["train_step"](app)
            _stdout, stderr = child.communicate(timeout=HANG_S)
            assert child.returncode == 0, stderr.decode()[-3000:]
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    moved = torch.load(out, weights_only=False)
    assert _equal(moved["state"], ns["snapshot"](app)), "the moved run diverged from the unmoved one"
    assert moved["state"]["step"] == 1 + 5 + more
    assert moved["rounds"][-1] == handed.round.seq and handed.round.final
    # the handoff delta moved what the last step changed, not the rest of the state
    assert 0 < handed.round.bytes_moved <= handed.round.bytes_total
    assert not os.path.exists(src.address), "the transport outlived the receive"


# -- a generating model --------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _llama(seed: int, max_len: int = 64) -> tuple[dict[str, Any], Any]:
    """A tiny Llama with a static KV cache; app_state holds the model, the cache's tensors
    (keys, values, lengths), the tokens so far and their count."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.cache_utils import StaticCache

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    cache.early_initialization(1, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                               torch.float32, torch.device("cpu"))
    kv = [t for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]
    app = {"model": model, "kv": kv, "tokens": torch.zeros(max_len, dtype=torch.long), "n": 0}
    return app, cache


def _generate(app: dict[str, Any], cache: Any, k: int) -> None:
    """``k`` greedy tokens (the first call reads a prompt into the cache)."""
    with torch.no_grad():
        for _ in range(k):
            n = app["n"]
            if n == 0:
                prompt = torch.tensor([1, 5, 9, 17, 33])
                app["tokens"][: len(prompt)] = prompt
                ids, positions, n = prompt.view(1, -1), torch.arange(len(prompt)), len(prompt)
            else:
                ids, positions = app["tokens"][n - 1 : n].view(1, 1), torch.tensor([n - 1])
            logits = app["model"](input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True).logits
            app["tokens"][n] = logits[0, -1].argmax()
            app["n"] = n + 1


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize(("lazy", "fast"), [(False, True), (False, False), (True, False), (True, True)],
                         ids=["eager-fast", "eager-general", "lazy-general", "lazy-fast"])
def test_a_generating_model_continues_with_the_tokens_of_an_unmoved_run(lazy: bool, fast: bool) -> None:
    app, cache = _llama(seed=0)
    _generate(app, cache, 2)
    moved, moved_cache = _llama(seed=1)  # other weights, an empty cache: all must come over
    applied = Applied()
    with Source(app, config=CFG, fast_handoff=fast) as src, Target(src.address, on_round=applied) as dst:

        def receive_and_go_on() -> Any:
            info = dst.receive(moved, lazy=lazy)  # (lazy: the gate holds on this thread)
            _generate(moved, moved_cache, 10)
            dst.wait()
            return info

        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["info"] = receive_and_go_on()
            except BaseException as exc:
                out["error"] = exc

        thread = threading.Thread(target=run, name="test-target")
        thread.start()
        for _ in range(4):  # serving goes on: a token, a round (applied before the next)
            _generate(app, cache, 1)
            src.precopy(wait=True)
            applied.wait_for(src.rounds[-1].seq)
        _generate(app, cache, 2)  # tokens the rounds did not see: the last delta carries them
        handed = src.handoff()
        info = _join(thread, out)
    _generate(app, cache, 10)  # the unmoved run
    assert moved["n"] == app["n"] == 5 + 2 + 4 + 2 + 10
    assert moved["tokens"].tolist() == app["tokens"].tolist()
    final = info.rounds[-1]
    # (a fast handoff's delta is put in place before receive() returns, whatever lazy asks)
    assert final.fast is handed.round.fast is fast and (handed.general_why is None) is fast
    assert info.lazy is (lazy and not fast) and final.final and [r.seq for r in info.rounds] == [1, 2, 3, 4, 5]
    assert 0 < final.bytes_moved < final.bytes_total / 4, "the last delta moved more than the tokens' cache rows"
    assert not final.full


# -- what rounds move ----------------------------------------------------------------------------
def test_rounds_after_the_first_move_only_the_chunks_that_changed() -> None:
    chunk = CFG.chunk_size
    data = torch.randn(64 * chunk // 4, generator=torch.Generator().manual_seed(0))  # 64 distinct chunks
    app = {"big": data, "step": 0}
    copy = {"big": torch.zeros_like(data), "step": -1}
    applied = Applied()
    with Source(app, config=CFG) as src, Target(src.address, on_round=applied) as dst:
        thread, out = _receive_in_thread(dst, copy)
        src.precopy(wait=True)
        applied.wait_for(1)
        app["big"][3] = 1.0  # one chunk
        app["big"][40 * chunk // 4 : 42 * chunk // 4] = torch.arange(2 * chunk // 4.0)  # two more, side by side
        app["step"] = 1
        src.precopy(wait=True)
        applied.wait_for(2)
        app["big"][-1] = 3.0  # the last chunk only
        app["step"] = 2
        handed = src.handoff()
        info = _join(thread, out)
    total = app["big"].numel() * 4
    first, second, last = src.rounds
    assert first.bytes_moved == total and second.bytes_moved == 3 * chunk and last.bytes_moved == chunk
    assert handed.round == last and last.final
    rounds = applied.rounds
    assert [r.seq for r in rounds] == [1, 2, 3]
    assert [r.bytes_moved for r in rounds] == [total, 3 * chunk, chunk]
    assert [r.chunks_moved for r in rounds] == [64, 3, 1]
    assert [r.full for r in rounds] == [True, False, False]
    assert info.rounds == tuple(rounds) and info.checkpoint == last.id
    assert torch.equal(copy["big"], app["big"]) and copy["step"] == 2


def test_a_target_that_comes_late_takes_the_newest_round_and_the_source_keeps_no_other() -> None:
    app = {"w": torch.zeros(10_000), "step": 0}
    with Source(app, config=CFG) as src:
        for step in range(1, 5):
            app["w"] += 1
            app["step"] = step
            src.precopy(wait=True)
        assert [m.tag for m in Repository.open(src.address).list()] == ["migrate-000004"]
        copy = {"w": torch.zeros(10_000), "step": -1}
        applied = Applied()
        with Target(src.address, on_round=applied) as dst:
            thread, out = _receive_in_thread(dst, copy)
            applied.wait_for(4)
            assert copy["step"] == 4 and torch.equal(copy["w"], app["w"])  # a consistent round, before the handoff
            app["w"][0] = -1.0
            app["step"] = 5
            src.handoff()
            _join(thread, out)
    assert [r.seq for r in applied.rounds] == [4, 5]
    assert copy["step"] == 5 and torch.equal(copy["w"], app["w"])


def test_the_transport_is_private_and_removed_after_the_receive() -> None:
    app = {"w": torch.arange(5000.0), "tag": "x"}
    with Source(app, config=CFG) as src:
        root = Path(src.address)
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert stat.S_IMODE(root.parent.stat().st_mode) == 0o700
        src.precopy(wait=True)
        with Target(src.address) as dst:
            made = [p for p in root.rglob("*") if not p.is_dir()]
            assert made and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in made), \
                [(str(p), oct(p.stat().st_mode)) for p in made if p.stat().st_mode & 0o077]
            src.handoff()
            copy = {"w": torch.zeros(5000), "tag": ""}
            dst.receive(copy)
    assert copy["tag"] == "x" and torch.equal(copy["w"], app["w"])
    assert not root.exists()


def test_a_root_elsewhere_carries_the_rounds_polled_without_a_bell() -> None:
    """A transport that is a URL (here fsspec's memory://, one process): no bell, no locks;
    the target lists the rounds every poll_s."""
    import uuid

    root = f"memory://gpusnap-migrate-{uuid.uuid4().hex}"
    app = {"w": torch.arange(3000.0), "step": 0}
    copy = {"w": torch.zeros(3000), "step": -1}
    with Source(app, root, config=CFG) as src, Target(root, poll_s=0.01) as dst:
        thread, out = _receive_in_thread(dst, copy)
        src.precopy(wait=True)
        app["w"][7] = -7.0
        app["step"] = 1
        src.handoff()
        info = _join(thread, out)
    assert copy["step"] == 1 and torch.equal(copy["w"], app["w"])
    assert info.rounds[-1].final
    import fsspec

    assert not fsspec.filesystem("memory").exists(root.removeprefix("memory://"))


def test_after_the_handoff_the_source_refuses_to_go_on() -> None:
    app = {"w": torch.zeros(100)}
    with Source(app, config=CFG) as src:
        src.handoff()
        assert src.handed_off
        with pytest.raises(MigrationError, match="belongs to the target"):
            src.precopy()
        with pytest.raises(MigrationError, match="belongs to the target"):
            src.handoff()
        with Target(src.address) as dst:
            dst.receive({"w": torch.ones(100)})


def test_a_round_the_target_reads_stays_while_newer_ones_come_and_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim: the source keeps the round the target reads (and its newest), deletes the
    rest; the target then goes straight to the newest."""
    from restore_support import HeldBackend

    from gpusnap.storage.backend import LocalBackend

    class Parked(HeldBackend):
        """Reads held: ``waiting`` is set once one waits (its round claimed before it)."""

        def __init__(self, inner: LocalBackend) -> None:
            super().__init__(inner)
            self.waiting = threading.Event()

        def readinto_range(self, path: str, offset: int, out: memoryview) -> int:
            if not self._open.is_set():
                self.waiting.set()
            return super().readinto_range(path, offset, out)

    app = {"w": torch.arange(20_000.0), "step": 1}
    copy = {"w": torch.zeros(20_000), "step": -1}
    applied = Applied()
    with Source(app, config=CFG) as src:
        held = Parked(LocalBackend(src.address))
        real_open = Repository.open.__func__  # type: ignore[attr-defined]
        with monkeypatch.context() as patch:  # (the target's reads only: the source opened its own)
            patch.setattr(Repository, "open", classmethod(lambda cls, where, **kw: real_open(
                cls, where, **{**kw, "backend": held})))
            dst = Target(src.address, on_round=applied)
        with dst:
            thread, out = _receive_in_thread(dst, copy)
            src.precopy(wait=True)
            applied.wait_for(1)
            held.hold()
            app["w"] += 1
            app["step"] = 2
            src.precopy(wait=True)
            assert held.waiting.wait(HANG_S)  # the target claimed round 2 and waits in its reads
            for step in (3, 4):
                app["w"] += 1
                app["step"] = step
                src.precopy(wait=True)
            tags = [m.tag for m in Repository.open(src.address).list()]
            assert tags == ["migrate-000002", "migrate-000004"], tags  # round 3 went, round 2 stayed
            held.release()
            applied.wait_for(4)
            app["step"] = 5
            src.handoff()
            _join(thread, out)
    assert [r.seq for r in applied.rounds] == [1, 2, 4, 5]
    assert copy["step"] == 5 and torch.equal(copy["w"], app["w"])


def test_a_tensor_laid_out_otherwise_moves_whole_when_any_chunk_of_it_changed() -> None:
    """A transposed tensor is no run of its span's bytes in the target's order: a changed
    chunk moves its whole span (restore.delta); a contiguous one only that chunk."""
    chunk = CFG.chunk_size
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(64, chunk // 4 // 4, generator=gen)  # 16 chunks, held transposed
    flat = torch.randn(16 * chunk // 4, generator=gen)  # 16 chunks, contiguous
    app = {"t": base.t(), "flat": flat}
    copy = {"t": torch.zeros_like(base).t(), "flat": torch.zeros_like(flat)}
    applied = Applied()
    with Source(app, config=CFG) as src, Target(src.address, on_round=applied) as dst:
        thread, out = _receive_in_thread(dst, copy)
        src.precopy(wait=True)
        applied.wait_for(1)
        base[0, 0] = 100.0
        flat[0] = 100.0
        src.handoff()
        info = _join(thread, out)
    assert info.rounds[-1].bytes_moved == base.numel() * 4 + chunk
    assert torch.equal(copy["t"], app["t"]) and torch.equal(copy["flat"], app["flat"])


def test_a_root_is_free_for_the_next_migration_as_soon_as_receive_returns(tmp_path: Path) -> None:
    """Moving A -> B and straight back through the same root: the spent transport is renamed
    out of the way inside receive() (its removal goes on behind), so the next Source finds
    the root free at once, and the removal behind never touches the new migration's files."""
    root = tmp_path / "move"
    for i in range(3):
        app = {"w": torch.arange(5000.0) + i, "step": i}
        with Source(app, to=str(root), config=CFG) as src:
            src.precopy(wait=True)
            with Target(src.address) as dst:
                src.handoff()
                copy = {"w": torch.zeros(5000), "step": -1}
                dst.receive(copy)
                assert not root.exists(), "receive() returned with the spent transport still at its path"
        assert copy["step"] == i and torch.equal(copy["w"], app["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a spent transport outlived its Target"


def test_a_new_source_removes_what_a_target_killed_while_removing_left(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    cfg = Config(chunk_size=4096, io_threads=1, memory_tier_dir=str(shm))
    parent = shm / f"gpusnap-{os.geteuid()}"
    parent.mkdir(mode=0o700)
    left = parent / ".removing-0123456789abcdef"
    (left / "packs").mkdir(parents=True)
    (left / "packs" / "p").write_bytes(b"x" * 100)
    with Source({"w": torch.ones(10)}, config=cfg) as src:
        assert not left.exists()
        assert os.path.isdir(src.address)
