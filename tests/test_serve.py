"""The restore server (``gpusnap serve``; ``serving/``, ``restore/via_server/``): a restore
served from the server's host memory is bit-exact, and every way the server can be absent,
stale or fail falls back to the files with the same result.

On CPU the server serves host memory: every span lands in shared memory the client passes
and is applied by the plan, the same protocol, checks and fallbacks as the CUDA path, whose
copies go over CUDA IPC instead (``test_serve_cuda.py``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from restore_support import add_device_hashes, blank_like, mixed_state, states_equal, tiny_config
from serve_support import HANG_S, SRC, private_runtime, running_server  # noqa: F401 (a fixture)
from test_restore_cold import TinyLM

import gpusnap
from gpusnap.restore.pipeline.staging import can_share
from gpusnap.restore.via_server import client as server_client
from gpusnap.restore.via_server import connection, paths, protocol

pytestmark = pytest.mark.skipif(not can_share(), reason="the restore server needs memfd (Linux)")


def _save(root: Path, state: dict[str, Any]) -> str:
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        return ck.save(state, blocking=True).wait().id


def _restore(root: Path, state: dict[str, Any], checkpoint: str | None = None, **config: Any) -> dict[str, Any]:
    with gpusnap.Checkpointer(root, config=tiny_config(**config)) as ck:
        return ck.restore(state, checkpoint).stats


def _quietly(root: Path, state: dict[str, Any], **config: Any) -> dict[str, Any]:
    """A restore that must not warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return _restore(root, state, **config)


def _tensor_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def test_an_eager_restore_is_served_bit_exact(tmp_path: Path, private_runtime: Path) -> None:
    source = mixed_state()  # big spans, small ones and a transposed tensor (not streamable)
    cid = _save(tmp_path / "ck", source)
    with running_server(tmp_path / "ck") as server:
        target = blank_like(source)
        stats = _quietly(tmp_path / "ck", target)
        assert states_equal(target, source)
        assert stats["source"] == "server" and stats["mode"] == "eager" and stats["verify"] == "server"
        served = stats["served"]
        assert served["bytes"] == served["landed_bytes"] == _tensor_bytes(source)  # (CPU: all lands)
        assert served["pid"] == server.proc.pid and served["handles"] == 0
        assert server.next_event("served")["id"] == cid


def test_lazy_restores_and_cold_start_are_served_complete(tmp_path: Path, private_runtime: Path) -> None:
    torch.manual_seed(0)
    trained = TinyLM(layers=6)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        expected = trained(ids)
    _save(tmp_path / "ck", {"model": trained, "step": 5})
    with running_server(tmp_path / "ck"), gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        state: dict[str, Any] = {"step": 0}
        model, handle = gpusnap.cold_start(lambda: TinyLM(layers=6), ck, device="cpu", app_state=state)
        assert handle.done() and state["step"] == 5, "served before cold_start returns"
        assert handle.stats["source"] == "server" and handle.stats["served_lazy"] is True
        with torch.no_grad():
            assert torch.equal(model(ids), expected)
        assert model.head.weight is model.emb.weight
        again = TinyLM(layers=6)
        h = ck.restore({"model": again, "step": 0}, lazy=True)
        assert h.done() and h.stats["source"] == "server"
        with torch.no_grad():
            assert torch.equal(again(ids), expected)


def test_no_server_is_quiet_in_auto_and_warned_when_on(tmp_path: Path, private_runtime: Path) -> None:
    source = mixed_state()
    _save(tmp_path / "ck", source)
    target = blank_like(source)
    stats = _quietly(tmp_path / "ck", target)
    assert states_equal(target, source) and stats["source"] == "files"
    assert "no restore server" in stats["server_fallback"]
    target = blank_like(source)
    with pytest.warns(RuntimeWarning, match="did not serve this restore"):
        stats = _restore(tmp_path / "ck", target, restore_from_server="on")
    assert states_equal(target, source) and stats["source"] == "files"
    stats = _quietly(tmp_path / "ck", blank_like(source), restore_from_server="off")
    assert stats["source"] == "files" and "server_fallback" not in stats


def test_a_stale_socket_is_ignored_then_replaced(tmp_path: Path, private_runtime: Path) -> None:
    source = mixed_state()
    _save(tmp_path / "ck", source)
    path = paths.socket_path(tmp_path / "ck", create=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # (the file stays, nobody listens: what a killed server leaves)
    target = blank_like(source)
    stats = _quietly(tmp_path / "ck", target)
    assert states_equal(target, source) and "stale socket" in stats["server_fallback"]
    with running_server(tmp_path / "ck"):
        target = blank_like(source)
        assert _quietly(tmp_path / "ck", target)["source"] == "server"
        assert states_equal(target, source)


@pytest.mark.parametrize("after", [0, 5000])
def test_a_server_killed_mid_transfer_falls_back_and_the_next_restore_works(
        tmp_path: Path, private_runtime: Path, after: int) -> None:
    source = mixed_state()
    _save(tmp_path / "ck", source)
    with running_server(tmp_path / "ck", env={"GPUSNAP_SERVE_FAULT": f"die-after={after}"}) as server:
        target = blank_like(source)
        with pytest.warns(RuntimeWarning, match="failed before its reply"):
            stats = _restore(tmp_path / "ck", target)
        assert states_equal(target, source) and stats["source"] == "files"
        assert server.proc.wait(HANG_S) == -signal.SIGKILL
        target = blank_like(source)
        stats = _quietly(tmp_path / "ck", target)  # its socket is stale now: quiet
        assert states_equal(target, source) and "stale socket" in stats["server_fallback"]


def test_a_server_that_stops_answering_is_given_up(tmp_path: Path, private_runtime: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    source = mixed_state()
    _save(tmp_path / "ck", source)
    monkeypatch.setattr(server_client, "REPLY_TIMEOUT_S", 0.0)  # (the server never answers anyway)
    with running_server(tmp_path / "ck", env={"GPUSNAP_SERVE_FAULT": "stall-after=0"}) as server:
        target = blank_like(source)
        with pytest.warns(RuntimeWarning, match="sent no reply in time"):
            stats = _restore(tmp_path / "ck", target)
        assert states_equal(target, source) and stats["source"] == "files"
        assert server.proc.poll() is None, "a server that wrote nothing into this process is not killed"


def test_a_newer_checkpoint_is_served_once_held(tmp_path: Path, private_runtime: Path) -> None:
    first = mixed_state()
    old = _save(tmp_path / "ck", first)
    with running_server(tmp_path / "ck") as server:
        second = {k: v * 2 if isinstance(v, torch.Tensor) else v for k, v in first.items()}
        new = _save(tmp_path / "ck", second)
        with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
            target = blank_like(second)
            with pytest.warns(RuntimeWarning, match=f"does not hold {new}"):
                stats = ck.restore(target).stats
            assert states_equal(target, second) and stats["source"] == "files"
            assert server.next_event("held")["id"] == new, "a miss makes the server look for new commits"
            with warnings.catch_warnings():  # the same kind of reason is warned once per Checkpointer
                warnings.simplefilter("error")
                ck.restore(blank_like(second))
            held = server.ask("refresh")["held"]
            assert [h["id"] for h in held] == [new]  # --keep 1
            assert server.next_event("dropped")["id"] == old
            target = blank_like(second)
            assert ck.restore(target).stats["source"] == "server" and states_equal(target, second)
            target = blank_like(first)
            assert ck.restore(target, old).stats["source"] == "files" and states_equal(target, first)


def test_a_different_manifest_under_the_same_id_is_refused(tmp_path: Path, private_runtime: Path) -> None:
    source = mixed_state()
    cid = _save(tmp_path / "ck", source)
    with running_server(tmp_path / "ck"):
        add_device_hashes(tmp_path / "ck", cid)  # same id, same bytes, another manifest
        target = blank_like(source)
        with pytest.warns(RuntimeWarning, match="differs from this one"):
            stats = _restore(tmp_path / "ck", target)
        assert states_equal(target, source) and stats["source"] == "files"


def test_concurrent_clients_are_each_served(tmp_path: Path, private_runtime: Path) -> None:
    source = mixed_state()
    _save(tmp_path / "ck", source)
    results: list[tuple[bool, str]] = []
    with running_server(tmp_path / "ck"):
        def client() -> None:
            target = blank_like(source)
            stats = _restore(tmp_path / "ck", target)
            results.append((states_equal(target, source), stats["source"]))

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S)
    assert results == [(True, "server")] * 4


def test_strict_false_asks_only_for_the_keys_restored(tmp_path: Path, private_runtime: Path) -> None:
    source = mixed_state()
    _save(tmp_path / "ck", source)
    with running_server(tmp_path / "ck"), gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        target = {"big0": torch.zeros_like(source["big0"]), "t": torch.zeros_like(source["t"])}
        stats = ck.restore(target, strict=False).stats
    assert stats["source"] == "server" and stats["served"]["bytes"] == _tensor_bytes(target)
    assert torch.equal(target["big0"], source["big0"]) and torch.equal(target["t"], source["t"])
    assert "big1" in stats["unexpected"]


def test_one_server_per_root_private_socket_and_a_clean_stop(tmp_path: Path, private_runtime: Path) -> None:
    _save(tmp_path / "ck", mixed_state())
    with running_server(tmp_path / "ck") as server:
        path = paths.socket_path(tmp_path / "ck")
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.stat(private_runtime / "gpusnap").st_mode & 0o777 == 0o700
        second = subprocess.run([sys.executable, "-m", "gpusnap", "serve", str(tmp_path / "ck"), "--device", "cpu"],
                                capture_output=True, text=True, timeout=HANG_S, env={**os.environ, "PYTHONPATH": SRC})
        assert second.returncode == 2 and "already serves" in second.stderr
        assert server.stop(signal.SIGINT) == 0
        assert not os.path.exists(path), "the socket is removed"
        assert server.next_event("stopped")["why"] == "asked"


def test_a_socket_directory_others_may_write_is_refused(tmp_path: Path, private_runtime: Path) -> None:
    source = mixed_state()
    _save(tmp_path / "ck", source)
    (private_runtime / "gpusnap").mkdir(mode=0o700)
    os.chmod(private_runtime / "gpusnap", 0o777)
    target = blank_like(source)
    stats = _quietly(tmp_path / "ck", target)  # (no server of this user's can listen there)
    assert states_equal(target, source) and "only it may write" in stats["server_fallback"]
    with pytest.warns(RuntimeWarning, match="only it may write"):
        _restore(tmp_path / "ck", blank_like(source), restore_from_server="on")
    proc = subprocess.run([sys.executable, "-m", "gpusnap", "serve", str(tmp_path / "ck"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=HANG_S, env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 2 and "only it may write" in proc.stderr


def _raw_request(root: Path, request: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]:
    import time

    conn, _ = connection.connect(paths.socket_path(root), timeout=HANG_S)
    with conn:
        connection.read_hello(conn, time.monotonic() + HANG_S)
        protocol.send_msg(conn, request, fds)
        reply, _ = protocol.recv_msg(conn, time.monotonic() + HANG_S)
    return reply  # type: ignore[no-any-return]


def test_bad_requests_are_refused_and_the_server_goes_on(tmp_path: Path, private_runtime: Path) -> None:
    source = mixed_state()
    cid = _save(tmp_path / "ck", source)
    root = tmp_path / "ck"
    with running_server(root) as server:
        digest = server.ask("status")["held"][0]["digest"]
        base = {"op": "restore", "id": cid, "digest": digest}
        unsealed = os.memfd_create("test", os.MFD_CLOEXEC)
        os.ftruncate(unsealed, 4096)
        sealed = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(sealed, 4096)
        import fcntl

        fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        fd_dest = [{"kind": "fd", "fd": 0, "size": 4096}]
        cases = [
            ({**base, "dests": fd_dest, "copies": [[0, 0, 100, 0, 0]]}, (), "descriptor"),
            ({**base, "dests": fd_dest, "copies": [[0, 0, 100, 0, 0]]}, (unsealed,), "sealed"),
            ({**base, "dests": fd_dest, "copies": [[0, 0, 100, 0, 4000]]}, (sealed,), "outside destination"),
            ({**base, "dests": fd_dest, "copies": [[0, 10 ** 9, 100, 0, 0]]}, (sealed,), "outside span"),
            ({**base, "dests": fd_dest, "copies": [[999, 0, 1, 0, 0]]}, (sealed,), "does not exist"),
            ({**base, "dests": [{"kind": "cuda", "handle": "00", "size": 1}], "copies": []}, (), "host only"),
            ({**base, "dests": fd_dest, "copies": "x"}, (sealed,), "must be a list"),
            ({**base, "digest": "0" * 32, "dests": [], "copies": []}, (), "digest"),
            ({"op": "nope"}, (), "unknown op"),
        ]
        for request, fds, why in cases:
            reply = _raw_request(root, request, fds)
            assert reply["ok"] is False and why in reply["why"], (why, reply)
        os.close(unsealed)
        os.close(sealed)
        target = blank_like(source)
        assert _quietly(root, target)["source"] == "server" and states_equal(target, source)


def test_a_server_started_before_its_root_serves_once_there_is_a_checkpoint(
        tmp_path: Path, private_runtime: Path) -> None:
    with running_server(tmp_path / "ck") as server:
        assert any('"waiting"' in line for line in server.lines)
        source = mixed_state()
        cid = _save(tmp_path / "ck", source)
        assert [h["id"] for h in server.ask("refresh")["held"]] == [cid]
        target = blank_like(source)
        assert _quietly(tmp_path / "ck", target)["source"] == "server" and states_equal(target, source)


def test_bad_config_values_are_refused() -> None:
    with pytest.raises(ValueError, match="restore_from_server"):
        gpusnap.Config(restore_from_server="always")
