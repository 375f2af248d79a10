"""Pieces of the restore server on their own: socket paths, framing, the IPC handle's bytes,
the held layout, the fault hook (no server process)."""

from __future__ import annotations

import ctypes
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpusnap.restore.via_server import cuda_ipc, paths, protocol
from gpusnap.serving.held import ALIGN, layout
from gpusnap.serving.request import Fault


def test_a_root_and_a_link_to_it_share_one_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "root").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "root")
    a = paths.socket_path(tmp_path / "root", create=True)
    assert a == paths.socket_path(tmp_path / "link") and len(a.encode()) < 108
    assert a != paths.socket_path(tmp_path / "other")
    assert os.stat(tmp_path / "gpusnap").st_mode & 0o777 == 0o700


def test_frames_round_trip_and_garbage_is_a_protocol_error() -> None:
    a, b = socket.socketpair()
    with a, b:
        r, w = os.pipe()
        protocol.send_msg(a, {"x": [1, 2]}, (r,))
        msg, fds = protocol.recv_msg(b, time.monotonic() + 60)
        assert msg == {"x": [1, 2]} and len(fds) == 1
        for fd in (*fds, r, w):
            os.close(fd)
        a.sendall(protocol.LEN.pack(3) + b"{{{")
        with pytest.raises(protocol.ProtocolError, match="not a message"):
            protocol.recv_msg(b, time.monotonic() + 60)
        a.sendall(protocol.LEN.pack(protocol.MAX_FRAME + 1))
        with pytest.raises(protocol.ProtocolError, match="a frame of"):
            protocol.recv_msg(b, time.monotonic() + 60)
        with pytest.raises(TimeoutError):
            protocol.recv_msg(b, time.monotonic())
        a.close()
        with pytest.raises(protocol.ProtocolError, match="closed"):
            protocol.recv_msg(b, time.monotonic() + 60)


def test_an_ipc_handle_keeps_all_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handle has NUL bytes inside: a ``c_char`` field would cut it at the first."""
    raw = bytes(range(1, 20)) + b"\0" + bytes(range(30, 74))
    handle = cuda_ipc.IpcHandle.from_bytes(raw)
    assert handle.reserved == raw[:19], "the field alone stops at the NUL"
    assert handle.to_bytes() == raw

    def get(out: Any, base: Any) -> int:
        ctypes.memmove(out, raw, 64)
        return 0

    monkeypatch.setattr(cuda_ipc, "cudart", lambda: SimpleNamespace(cudaIpcGetMemHandle=get))  # the runtime, faked
    assert cuda_ipc.mem_handle(0x1000) == raw


def test_held_spans_start_on_pages() -> None:
    manifest = SimpleNamespace(storages=[SimpleNamespace(nbytes=n) for n in (1, 0, ALIGN, ALIGN + 1)])
    assert layout(manifest) == ((0, ALIGN, ALIGN, 2 * ALIGN), 4 * ALIGN)  # type: ignore[arg-type]


@pytest.mark.parametrize("raw, fault", [("die-after=10", Fault("die", 10)), ("stall-after=0", Fault("stall", 0)),
                                        ("", None), ("die-after=x", None), ("boom-after=1", None)])
def test_the_fault_hook_reads_its_variable(monkeypatch: pytest.MonkeyPatch, raw: str, fault: Fault | None) -> None:
    monkeypatch.setenv("GPUSNAP_SERVE_FAULT", raw)
    assert Fault.from_env() == fault
