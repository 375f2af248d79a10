"""The fast handoff (gpusnap.migrate): the last delta as the chunks that changed since the
newest round, found by comparing digests taken at that round's consistent point with the
state's now, copied into a file the source prepared and checked chunk by chunk by the target
before it writes a byte.

It is taken only when it can be exact; otherwise the handoff goes the general way (a last
round saved as a checkpoint) and says why: a state laid out otherwise, a delta larger than
the buffer, a header that cannot be committed. A damaged bytes file fails the target with
the round before in place; a hostile header is refused. Every test runs on CPU tensors
(BLAKE2b digests) and, on a GPU machine, on CUDA tensors (device hashes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch
from faults import FaultyBackend
from test_migrate import CFG, HANG_S, Applied, _join, _receive_in_thread

from gpusnap.errors import CheckpointError
from gpusnap.migrate import MigrationError, Source, Target
from gpusnap.migrate import delta_file
from gpusnap.migrate import source as source_module
from gpusnap.migrate.delta_file import DELTA_HEADER, DeltaHeader
from gpusnap.storage.backend import open_backend

CHUNK = CFG.chunk_size


def _app(device: torch.device) -> dict[str, Any]:
    data = torch.randn(64 * CHUNK // 4, generator=torch.Generator().manual_seed(0)).to(device)  # 64 distinct chunks
    return {"big": data, "small": torch.arange(100, dtype=torch.int16, device=device), "step": 0}


def _blank(device: torch.device) -> dict[str, Any]:
    return {"big": torch.zeros(64 * CHUNK // 4, device=device), "small": torch.zeros(100, dtype=torch.int16,
                                                                                    device=device), "step": -1}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and torch.equal(a["big"].cpu(), b["big"].cpu()) and torch.equal(
        a["small"].cpu(), b["small"].cpu())


def _two_rounds(src: Source, app: dict[str, Any], applied: Applied) -> None:
    """Rounds 1 and 2 applied (a fast handoff needs a target that applied one over another)."""
    src.precopy(wait=True)
    applied.wait_for(1)
    app["big"][7] += 1.0
    app["step"] = 1
    src.precopy(wait=True)
    applied.wait_for(2)


def test_a_fast_handoff_moves_the_changed_chunks_and_the_plain_values(device: torch.device) -> None:
    app, copy, applied = _app(device), _blank(device), Applied()
    with Source(app, config=CFG) as src, Target(src.address, on_round=applied) as dst:
        thread, out = _receive_in_thread(dst, copy)
        _two_rounds(src, app, applied)
        app["big"][3 * CHUNK // 4] = 5.0  # chunk 3
        app["big"][40 * CHUNK // 4 : 42 * CHUNK // 4] = 2.0  # chunks 40 and 41, side by side
        app["step"] = 2
        handed = src.handoff()
        info = _join(thread, out)
    assert handed.general_why is None and handed.round.fast and handed.round.final
    assert handed.round.bytes_moved == 3 * CHUNK and handed.round.id == src.rounds[1].id  # a delta on round 2
    last = info.rounds[-1]
    assert last.fast and last.final and last.bytes_moved == 3 * CHUNK and last.chunks_moved == 3
    assert [r.seq for r in applied.rounds] == [1, 2, 3]
    assert _same(copy, app)
    assert not os.path.exists(src.address), "the transport outlived the receive"


def test_a_tensor_the_program_replaced_moves_what_differs(device: torch.device) -> None:
    app, copy, applied = _app(device), _blank(device), Applied()
    with Source(app, config=CFG) as src, Target(src.address, on_round=applied) as dst:
        thread, out = _receive_in_thread(dst, copy)
        _two_rounds(src, app, applied)
        app["small"] = app["small"] * 3  # another tensor (another storage), laid out alike
        app["big"] = app["big"].clone()  # another one, the same bytes
        handed = src.handoff()
        _join(thread, out)
    assert handed.round.fast and handed.round.bytes_moved == 200  # all of "small", nothing of "big"
    assert _same(copy, app)


def test_a_state_laid_out_otherwise_hands_off_the_general_way() -> None:
    device = torch.device("cpu")
    app, copy, applied = _app(device), _blank(device), Applied()
    with Source(app, config=CFG) as src, Target(src.address, on_round=applied) as dst:
        thread, out = _receive_in_thread(dst, copy)
        _two_rounds(src, app, applied)
        app["small"] = torch.arange(50, dtype=torch.int16)  # fewer bytes: the spans differ
        copy["small"] = torch.zeros(50, dtype=torch.int16)
        handed = src.handoff()
        _join(thread, out)
    assert not handed.round.fast and "laid out otherwise" in (handed.general_why or "")
    assert _same(copy, app)


def test_a_delta_larger_than_the_buffer_hands_off_the_general_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delta_file, "CAPACITY_MIN", 2 * CHUNK)  # (a buffer of two chunks)
    monkeypatch.setattr(delta_file, "CAPACITY_MAX", 2 * CHUNK)
    device = torch.device("cpu")
    app, copy, applied = _app(device), _blank(device), Applied()
    with Source(app, config=CFG) as src, Target(src.address, on_round=applied) as dst:
        thread, out = _receive_in_thread(dst, copy)
        _two_rounds(src, app, applied)
        app["big"][: 10 * CHUNK // 4] = -1.0  # ten chunks
        handed = src.handoff()
        _join(thread, out)
    assert not handed.round.fast and "larger than the fast handoff's buffer" in (handed.general_why or "")
    assert _same(copy, app)


def _transport_backend(monkeypatch: pytest.MonkeyPatch) -> FaultyBackend:
    """The source's own files (the handoff's header) go through one FaultyBackend."""
    holder: dict[str, FaultyBackend] = {}

    def opening(root: str) -> FaultyBackend:
        holder["backend"] = FaultyBackend(open_backend(root))
        return holder["backend"]

    monkeypatch.setattr(source_module, "open_backend", opening)
    return holder  # type: ignore[return-value]


def test_a_header_that_cannot_be_committed_hands_off_the_general_way(monkeypatch: pytest.MonkeyPatch) -> None:
    holder: Any = _transport_backend(monkeypatch)
    device = torch.device("cpu")
    app, copy, applied = _app(device), _blank(device), Applied()
    with Source(app, config=CFG) as src, Target(src.address, on_round=applied) as dst:
        holder["backend"].fail_rename = lambda path: path == DELTA_HEADER
        thread, out = _receive_in_thread(dst, copy)
        _two_rounds(src, app, applied)
        app["big"][0] = 9.0
        app["step"] = 2
        handed = src.handoff()
        _join(thread, out)
    assert not handed.round.fast and "the fast handoff failed" in (handed.general_why or "")
    assert _same(copy, app)


def test_a_damaged_bytes_file_fails_the_target_with_the_round_before_in_place(
        device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    holder: Any = _transport_backend(monkeypatch)
    app, copy, applied = _app(device), _blank(device), Applied()
    with Source(app, config=CFG) as src, Target(src.address, on_round=applied) as dst:
        local = src.address

        def damage(path: str) -> None:  # the bytes are in; one flips before the header commits them
            if path == DELTA_HEADER:
                (data,) = [n for n in os.listdir(os.path.join(local, "migrate")) if n.endswith(".bin")]
                with open(os.path.join(local, "migrate", data), "r+b") as f:
                    first = f.read(1)
                    f.seek(0)
                    f.write(bytes([first[0] ^ 0xFF]))

        holder["backend"].before_rename = damage
        thread, out = _receive_in_thread(dst, copy)
        _two_rounds(src, app, applied)
        round2 = {"big": app["big"].clone(), "small": app["small"].clone(), "step": app["step"]}
        app["big"][5 * CHUNK // 4] = 7.0
        app["step"] = 2
        handed = src.handoff()
        thread.join(HANG_S)
    assert handed.round.fast and not thread.is_alive()
    error = out.get("error")
    assert isinstance(error, MigrationError) and "damaged" in str(error), out
    assert "holds round 2" in str(error) and "partly written" not in str(error)
    assert _same(copy, round2), "a byte of the damaged delta was written"


@pytest.mark.parametrize(("field", "value", "why"), [
    ("data", "../../etc/passwd", "is not a handoff-<token>.bin"),
    ("data", "handoff-0123456789abcdef.bin/x", "is not a handoff-<token>.bin"),
    ("runs", [[0, 0, 1 << 40, 0, "nh", ["0" * 32]]], "outside its span"),
    ("runs", [[5, 0, 16, 0, "nh", ["0" * 32]]], "outside its span"),
    ("runs", [[0, 0, 16, 1 << 30, "nh", ["0" * 32]]], "outside the data"),
    ("runs", [[0, 0, 16, 0, "nh", []]], "digests do not match"),
    ("runs", [[0, 0, 16, 0, "md5", ["0" * 32]]], "digests do not match"),
    ("runs", [[0, -16, 16, 0, "nh", ["0" * 32]]], "not a natural number"),
    ("tree", [], "tree is not an object"),
    ("format", "something else", "not a version 1"),
])
def test_a_hostile_header_is_refused(field: str, value: Any, why: str) -> None:
    doc = {"format": "gpusnap-migrate-delta", "version": 1, "token": "t", "base": "b", "seq": 3, "chunk_size": 16,
           "spans": [64], "data": "handoff-0123456789abcdef.bin", "nbytes": 64,
           "runs": [[0, 0, 16, 0, "nh", ["0" * 32]]], "tree": {"t": "dict"}}
    assert DeltaHeader.from_doc(doc).runs[0].stop == 16
    with pytest.raises(CheckpointError, match=why):
        DeltaHeader.from_doc({**doc, field: value})


def test_a_source_asked_for_no_fast_handoff_says_so() -> None:
    device = torch.device("cpu")
    app, copy, applied = _app(device), _blank(device), Applied()
    with Source(app, config=CFG, fast_handoff=False) as src, Target(src.address, on_round=applied) as dst:
        thread, out = _receive_in_thread(dst, copy)
        _two_rounds(src, app, applied)
        handed = src.handoff()
        _join(thread, out)
    assert not handed.round.fast and handed.general_why == "Source(fast_handoff=False)"
    assert _same(copy, app)
    with pytest.raises(TypeError, match="fast_handoff must be a bool"):
        Source(app, config=CFG, fast_handoff="yes")  # type: ignore[arg-type]


def test_a_source_called_off_leaves_no_bytes_file_in_a_root_it_was_given(tmp_path: Any) -> None:
    root = tmp_path / "root"
    app = _app(torch.device("cpu"))
    with Source(app, to=root, config=CFG) as src:
        src.precopy(wait=True)  # (the bytes file is made at the first round)
    assert not any(n.startswith("handoff-") for n in os.listdir(root / "migrate")), "host memory held after close()"


def test_a_target_not_caught_up_gets_the_general_way_whatever_its_claim_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """The target's claim describes the round it applied last; a handoff based on a newer
    one (spans added meanwhile: an optimizer's first step) must not trust it."""
    import gpusnap
    from gpusnap.storage.repository import Repository

    reading = threading.Event()  # set: the target's reads of packs wait for `go`
    go = threading.Event()
    real_open = Repository.open.__func__  # type: ignore[attr-defined]

    class Held(FaultyBackend):
        def readinto_range(self, path: str, offset: int, out: Any) -> Any:
            if reading.is_set() and threading.current_thread().name == "test-target":
                go.wait(HANG_S)
            return super().readinto_range(path, offset, out)

        def read_range(self, path: str, *a: Any, **k: Any) -> Any:
            if reading.is_set() and path.startswith("packs/") and threading.current_thread().name == "test-target":
                go.wait(HANG_S)
            return super().read_range(path, *a, **k)

    monkeypatch.setattr(Repository, "open", classmethod(
        lambda cls, root, **kw: real_open(cls, root, **{**kw, "backend": Held(open_backend(root))})))

    def build(seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(64, 64)
        return {"model": model, "optim": torch.optim.AdamW(model.parameters()), "rng": gpusnap.RNGState(), "step": 0}

    app, copy, applied = build(0), build(1), Applied()
    with Source(app, config=CFG) as src, Target(src.address, on_round=applied) as dst:
        thread, out = _receive_in_thread(dst, copy)
        src.precopy(wait=True)
        applied.wait_for(1)
        torch.rand(3)  # (the RNG state moves)
        src.precopy(wait=True)
        applied.wait_for(2)
        app["model"](torch.randn(4, 64)).pow(2).mean().backward()
        app["optim"].step()  # the optimizer's state appears: spans before "rng"
        app["step"] = 1
        reading.set()  # the target will not have applied round 3 when the source hands off
        src.precopy(wait=True)
        handed = src.handoff()
        go.set()
        _join(thread, out)
    assert not handed.round.fast and "applied the newest round" in (handed.general_why or "")
    assert all(torch.equal(a, b) for a, b in zip(app["model"].parameters(), copy["model"].parameters()))
    assert copy["step"] == 1 and copy["optim"].state_dict()["state"][0]["step"] == 1


def test_a_fast_handoff_whose_target_died_stays_for_a_new_target(tmp_path: Any) -> None:
    """Both sides gone after a fast handoff: the next Source of the user must not sweep the
    transport away (a target can still complete it), and a new Target does."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, threading, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_migrate import CFG, Applied
        from gpusnap.migrate import Source, Target
        torch.manual_seed(0)
        app = {{"big": torch.randn(64 * CFG.chunk_size // 4), "step": 0}}
        copy = {{"big": torch.zeros(64 * CFG.chunk_size // 4), "step": -1}}
        applied, never = Applied(), threading.Event()

        def on_round(r):
            applied(r)
            if r.seq == 2:
                never.wait()          # the target stops here: round 2 applied and claimed
        src = Source(app, config=CFG)
        dst = Target(src.address, on_round=on_round)
        threading.Thread(target=dst.receive, args=(copy,), daemon=True).start()
        src.precopy(wait=True); applied.wait_for(1)
        app["big"][0] += 1; src.precopy(wait=True); applied.wait_for(2)
        app["big"][3] += 1; app["step"] = 7
        handed = src.handoff()
        torch.save(app, {str(tmp_path / "expected.pt")!r})
        print(src.address, handed.round.fast, flush=True)
        os._exit(0)                   # both sides die: the transport holds round 2 and the delta
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_S, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    address, fast = run.stdout.split()
    assert fast == "True"
    Source({"x": torch.zeros(4)}, config=CFG).close()  # the user's next migration sweeps dead transports
    assert os.path.exists(address), "a fast handoff a target can still complete was swept away"
    copy = {"big": torch.zeros(64 * CHUNK // 4), "step": -1}
    with Target(address) as dst:
        info = dst.receive(copy)
    expected = torch.load(tmp_path / "expected.pt")
    assert info.rounds[-1].fast and copy["step"] == 7 and torch.equal(copy["big"], expected["big"])


SMALL_SHM = textwrap.dedent("""
    import dataclasses, subprocess, sys, threading
    mount = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", mount], check=True)
    sys.path.insert(0, sys.argv[2])
    import torch
    from test_migrate import CFG, Applied, _receive_in_thread, _join
    from gpusnap.migrate import Source, Target
    cfg = dataclasses.replace(CFG, memory_tier_dir=mount)
    app, copy, applied = {"w": torch.randn(2 << 20), "step": 0}, {"w": torch.zeros(2 << 20), "step": -1}, Applied()
    with Source(app, config=cfg) as src, Target(src.address, on_round=applied) as dst:
        thread, out = _receive_in_thread(dst, copy)
        for k in range(1, 4):
            app["w"][k] += 1; app["step"] = k
            src.precopy(wait=True); applied.wait_for(k)
        app["w"][0] += 1
        handed = src.handoff()
        _join(thread, out)
    print(handed.round.fast, torch.equal(copy["w"], app["w"]) and copy["step"] == 3)
""")


def test_a_64_mib_shm_migrates_an_8_mib_state_the_fast_way(tmp_path: Any) -> None:
    """A container's default /dev/shm: the bytes file is sized to the state and the room left
    beside the rounds, not a fixed share (which took the rounds' space)."""
    from fast_support import run_on_small_tmpfs

    run = run_on_small_tmpfs(tmp_path, SMALL_SHM, os.path.dirname(__file__))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "True"]


def test_a_view_of_a_mapped_bytes_file_keeps_it_mapped(tmp_path: Any) -> None:
    import mmap

    from gpusnap.migrate.delta_file import mapped_bytes

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 16)
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 4096)
    view = mapped_bytes(mapped)[100:200]
    with pytest.raises(BufferError):
        mapped.close()  # (refused while a view lives: no view reads unmapped memory)
    del mapped
    assert view[0].item() == 100


def test_a_bytes_file_mapped_ahead_gives_its_bytes_only_for_its_name_and_size(tmp_path: Any) -> None:
    from gpusnap.migrate.delta_premap import Premap

    path = tmp_path / "handoff-0123456789abcdef.bin"
    path.write_bytes(bytes(range(256)) * 16)
    path.chmod(0o600)
    premap = Premap(str(path), None)
    assert premap.wait_ready(HANG_S) and premap.error is None and not premap.empty
    view, locked = premap.view_for(path.name, 300)
    assert bytes(view.numpy()) == (bytes(range(256)) * 2)[:300] and not locked
    assert premap.view_for("handoff-ffffffffffffffff.bin", 300) is None  # (another file)
    assert premap.view_for(path.name, 4097) is None  # (a header naming more than the file holds)
    premap.close()
    assert premap.view_for(path.name, 300) is None
    assert view[5].item() == 5  # (a view taken before keeps the mapping alive)


@pytest.mark.parametrize("name", ["handoff-0123456789abcdef.bin\n", "../handoff-0123456789abcdef.bin",
                                  "handoff-0123456789ABCDEF.bin", "handoff-.bin", "handoff-None.bin"])
def test_only_a_bytes_file_name_of_the_transport_is_taken(name: str) -> None:
    assert not delta_file.is_buffer_name(name)
    assert delta_file.is_buffer_name("handoff-0123456789abcdef.bin")


def test_a_bytes_file_not_yet_sized_is_mapped_later(tmp_path: Any) -> None:
    from gpusnap.migrate.delta_premap import Premap

    path = tmp_path / "handoff-0123456789abcdef.bin"
    path.write_bytes(b"")
    path.chmod(0o600)
    premap = Premap(str(path), None)
    assert premap.wait_ready(HANG_S) and premap.empty and premap.view_for(path.name, 0) is None
    premap.close()


def test_a_source_dropped_without_close_lets_go_of_its_bytes_file(tmp_path: Any) -> None:
    import gc

    root = tmp_path / "root"
    src = Source(_app(torch.device("cpu")), to=root, config=CFG)
    src.precopy(wait=True)
    del src
    gc.collect()
    assert not any(n.startswith("handoff-") for n in os.listdir(root / "migrate")), "host memory held"
