"""kernels.gather_copy: many spans, given by address, into one buffer with one launch."""

from __future__ import annotations

import importlib.util
import textwrap

import numpy as np
import pytest
import torch

from gpusnap.kernels import gather_copy as gc
from tests.test_chunk_hash_many import _interpreter_path, run_interpreted

# (source offset in the store, length): aligned and unaligned starts, odd lengths, an empty
# span, spans of many tiles and of a partial last tile
SPANS = [(0, 4096), (16, 40_000), (3, 1000), (64, 0), (1000, 17), (2048, 123_457), (5, 70_001), (4096, 16)]


def layout(spans: list[tuple[int, int]], align: int = 16) -> tuple[list[int], int]:
    """Destination offsets, each aligned, and the buffer's size."""
    offsets, pos = [], 0
    for _, n in spans:
        offsets.append(pos)
        pos += n + (-n % align)
    return offsets, pos


def expected(store: torch.Tensor, spans: list[tuple[int, int]], offsets: list[int], size: int) -> torch.Tensor:
    want = torch.zeros(size, dtype=torch.uint8)
    for (s, n), o in zip(spans, offsets):
        want[o : o + n] = store[s : s + n].cpu()
    return want


def test_tile_table_cuts_spans_into_tiles() -> None:
    table = gc.tile_table(1000, [0, 64, 200], [5000, 7000, 9000], [40, 0, 33], tile_bytes=16)
    assert table.tolist() == [
        [5000, 5016, 5032, 9000, 9016, 9032],
        [1000, 1016, 1032, 1200, 1216, 1232],
        [16, 16, 8, 16, 16, 1],
    ]
    with pytest.raises(ValueError, match="multiple of 16"):
        gc.tile_table(0, [0], [0], [1], tile_bytes=24)
    with pytest.raises(ValueError, match="negative"):
        gc.tile_table(0, [0], [0], [-1])
    with pytest.raises(ValueError, match="one length"):
        gc.tile_table(0, [0, 1], [0], [1])


def test_gather_copy_tensors_equals_the_reference() -> None:
    store = torch.randint(0, 256, (300_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    offsets, size = layout(SPANS)
    out = torch.zeros(size, dtype=torch.uint8)
    gc.gather_copy_tensors(out, offsets, [store[s : s + n] for s, n in SPANS])
    assert torch.equal(out, expected(store, SPANS, offsets, size))


def test_gather_copy_host_equals_the_reference() -> None:
    store = torch.randint(0, 256, (300_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    offsets, size = layout(SPANS)
    out = torch.zeros(size, dtype=torch.uint8)
    gc.gather_copy_host(out, offsets, [store.data_ptr() + s for s, _ in SPANS], [n for _, n in SPANS])
    assert torch.equal(out, expected(store, SPANS, offsets, size))
    with pytest.raises(ValueError, match="within dst"):
        gc.gather_copy_host(out, [size - 4], [store.data_ptr()], [8])
    with pytest.raises(ValueError, match="CPU tensor"):
        gc.gather_copy_host(out.view(torch.int8), [0], [store.data_ptr()], [1])
    with pytest.raises(ValueError, match="one length"):
        gc.gather_copy_host(out, [0, 16], [store.data_ptr()], [1, 1])


def test_cpu_snapshot_of_tiny_and_big_spans_is_exact() -> None:
    """A CPU snapshot mixes memmoved scalars (an optimizer's steps) with big spans copied by
    torch; both must hold the state of save() after the program overwrites it."""
    from gpusnap.capture.window import _HOST_MOVE_MAX, CaptureWindow
    from gpusnap.state.flatten import flatten

    state = {f"step{i}": torch.tensor(float(i)) for i in range(50)}
    state["big"] = torch.arange(_HOST_MOVE_MAX // 4 + 7, dtype=torch.float32)
    state["view"] = state["big"][3:10]  # a view: one span with its base
    state["part"] = torch.arange(1000, dtype=torch.int64)[100:130]  # a span from byte 800 on
    want = {k: v.clone() for k, v in state.items()}
    flat = flatten(state)
    window = CaptureWindow(flat, order=range(len(flat.spans)), cow_budget=0, eager_cpu_bytes=0,
                           snapshot_cpu_bytes=1 << 30)
    assert window.all_snapshotted
    for v in state.values():
        v.add_(1)
    (snap,) = window.snapshot_buffers()
    for ws, off in zip(snap.spans, snap.offsets):
        got = snap.buffer[off : off + ws.nbytes]
        for path in ws.span.paths:
            t = want[path]
            if path == "view":
                continue
            assert torch.equal(got[: t.numel() * t.element_size()].view(t.dtype).reshape(t.shape), t), path


def test_a_shadow_of_a_storage_shrunk_unseen_reads_no_freed_memory(tmp_path) -> None:
    """The program frees a tracked CPU tensor's memory behind every hook's back (its
    storage resized from C++, as ``torch._C.StorageBase.resize_`` does), then runs an op that
    protects every span (a higher-order op): the copy-on-write shadow must not memmove from
    the freed memory (that crashed the process). The save fails; it is never committed
    wrong, and the program's op runs. In a subprocess: a crash is a failure, not the end of
    the test run. (The program cannot write the freed tensor itself: that crashes without
    gpusnap too.)"""
    import subprocess
    import sys

    script = textwrap.dedent(f"""
        import torch, gpusnap
        cfg = gpusnap.Config(chunk_size=4096, pack_size=64 * 1024, io_threads=1, staging_bytes=4096,
                             copy_piece_bytes=4096, fsync=False, cpu_snapshot_bytes=0, eager_cpu_bytes=0,
                             cow_budget_bytes=1 << 30)
        with gpusnap.Checkpointer({str(tmp_path / "ck")!r}, config=cfg) as ck:
            big, t = torch.randn(1 << 20), torch.randn(20000)
            pending = ck.save({{"big": big, "t": t}})
            torch._C.StorageBase.resize_(t.untyped_storage(), 0)
            try:
                torch.cond(big[0] > 0, lambda x: x + 1, lambda x: x - 1, (big[:4],))
            except Exception as exc:
                print("op raised", type(exc).__name__)
            try:
                pending.wait()
                print("saved")
            except Exception as exc:
                print("save failed", type(exc).__name__)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "saved" in done.stdout or "save failed" in done.stdout


def test_gather_copy_refuses_what_it_cannot_run() -> None:
    out = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="Triton and a CUDA tensor"):
        gc.gather_copy(out, [0], [out.data_ptr()], [8])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the compiled kernel is tested instead")
def test_triton_interpreter_gather_copy() -> None:
    """The kernel, interpreted on CPU addresses: wide and byte paths, several tile sizes."""
    path = _interpreter_path()
    if path is None:
        pytest.skip("no Triton >= 3.9 importable (set GPUSNAP_TRITON_PATH)")
    script = textwrap.dedent(
        """
        import torch
        from gpusnap.kernels import gather_copy as gc
        from tests.test_gather_copy import SPANS, expected, layout

        store = torch.randint(0, 256, (300_000,), dtype=torch.uint8)
        offsets, size = layout(SPANS)
        for tile, block in ((4096, 64), (1 << 20, 2048), (80, 16), (16, 2)):
            out = torch.zeros(size, dtype=torch.uint8)
            table = torch.from_numpy(gc.tile_table(out.data_ptr(), offsets,
                                                   [store.data_ptr() + s for s, _ in SPANS],
                                                   [n for _, n in SPANS], tile))
            gc._t_gather_kernel[(table.shape[1],)](table, table.shape[1], BLOCK=block, BLOCK_B=32)
            assert torch.equal(out, expected(store, SPANS, offsets, size)), tile
        print("interpreter ok")
        """
    )
    run_interpreted(script, path)


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("tile", [16, 4096, gc.DEFAULT_TILE_BYTES])
def test_gather_copy_on_cuda(tile: int) -> None:
    """Every byte lands at its offset, and nothing outside the spans is written."""
    store = torch.randint(0, 256, (300_000,), dtype=torch.uint8, device="cuda")
    offsets, size = layout(SPANS)
    out = torch.full((size + 64,), 7, dtype=torch.uint8, device="cuda")
    gc.gather_copy(out, offsets, [store.data_ptr() + s for s, _ in SPANS], [n for _, n in SPANS], tile_bytes=tile)
    want = torch.full((size + 64,), 7, dtype=torch.uint8)
    for (s, n), o in zip(SPANS, offsets):
        want[o : o + n] = store[s : s + n].cpu()
    assert torch.equal(out.cpu(), want)


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_gather_copy_of_many_tensors_in_stream_order() -> None:
    """A model's worth of storages of several dtypes, overwritten right after the copy was
    enqueued on the same stream: the buffer holds the values from before."""
    g = torch.Generator(device="cuda").manual_seed(3)
    tensors = [torch.randn(int(n), device="cuda", generator=g).to(dt)
               for n, dt in zip(np.random.default_rng(0).integers(1, 300_000, 400),
                                [torch.float32, torch.bfloat16, torch.int64, torch.uint8] * 100)]
    sizes = [t.untyped_storage().nbytes() for t in tensors]
    offsets, size = layout([(0, n) for n in sizes])
    before = [t.clone() for t in tensors]
    out = torch.empty(size, dtype=torch.uint8, device="cuda")
    gc.gather_copy(out, offsets, [t.data_ptr() for t in tensors], sizes)
    for t in tensors:
        t.zero_()
    for t, o, n, b in zip(tensors, offsets, sizes, before):
        assert torch.equal(out[o : o + n], b.reshape(-1).view(torch.uint8)), (o, n)
