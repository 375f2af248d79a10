"""Many spans in one call: chunk_hashes_many == chunk_hashes per span, bit for bit (torch
loop on CPU, Triton's kernels interpreted on CPU, compiled on CUDA), and HashTable.fill_many."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gpusnap.capture.validation import HashTable
from gpusnap.kernels import chunk_hash as ch
from gpusnap.kernels import chunk_hash_many as chm
from gpusnap.kernels.chunk_hash import chunk_hashes
from gpusnap.kernels.chunk_hash_many import chunk_hashes_many, chunk_hashes_packed
from gpusnap.state.flatten import StorageSpan


def varied_spans(store: torch.Tensor, chunk_size: int) -> list[torch.Tensor]:
    """Empty, tiny, odd tails, chunk edges, several chunks; 16-byte aligned starts, then an
    unaligned and an 8-byte aligned one (views of one storage)."""
    sizes = [0, 1, 15, 16, 17, 4095, chunk_size - 1, chunk_size, chunk_size + 5,
             3 * chunk_size + 13, 4 * chunk_size, 0]
    spans, pos = [], 0
    for n in sizes:
        spans.append(store[pos : pos + n])
        pos += -(-(n + 1) // 16) * 16
    spans.append(store[pos + 3 : pos + 3 + 2 * chunk_size + 7])
    spans.append(store[pos + 8 : pos + 8 + 100])
    assert pos + 8 + 2 * chunk_size + 100 <= store.numel()
    return spans


def per_span(spans: list[torch.Tensor], chunk_size: int) -> torch.Tensor:
    parts = [chunk_hashes(s, chunk_size) for s in spans]
    return torch.cat(parts) if parts else torch.empty((0, 2), dtype=torch.int64)


def empty_out(spans: list[torch.Tensor], chunk_size: int, device: torch.device) -> torch.Tensor:
    rows = sum(ch.num_chunks(s.numel(), chunk_size) for s in spans)
    return torch.full((rows, 2), -1, dtype=torch.int64, device=device)


@pytest.mark.parametrize("chunk_size", [16, 64, 4096])
def test_many_equals_per_span(device: torch.device, chunk_size: int) -> None:
    store = torch.randint(0, 256, (13 * chunk_size + 20_000,), dtype=torch.uint8, device=device)
    spans = varied_spans(store, chunk_size)
    want = per_span(spans, chunk_size)
    out = empty_out(spans, chunk_size, device)
    assert chunk_hashes_many(spans, chunk_size, out) is out
    assert torch.equal(out, want)
    reordered = spans[::-1]
    assert torch.equal(chunk_hashes_many(reordered, chunk_size, empty_out(reordered, chunk_size, device)),
                       per_span(reordered, chunk_size))


def test_no_rows_and_bad_arguments() -> None:
    none = torch.empty((0, 2), dtype=torch.int64)
    assert chunk_hashes_many([], 16, none) is none
    assert chunk_hashes_many([torch.empty(0, dtype=torch.uint8)] * 3, 16, none) is none
    data = torch.zeros(40, dtype=torch.uint8)
    with pytest.raises(ValueError, match="shape \\(3, 2\\)"):
        chunk_hashes_many([data], 16, torch.empty((2, 2), dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple of 16"):
        chunk_hashes_many([data], 20, torch.empty((2, 2), dtype=torch.int64))
    with pytest.raises(TypeError, match="uint8"):
        chunk_hashes_many([data.view(torch.int32)], 16, torch.empty((1, 2), dtype=torch.int64))
    with pytest.raises(RuntimeError, match="CUDA"):
        chunk_hashes_many([data], 16, torch.empty((3, 2), dtype=torch.int64), impl="triton")


def test_row_table() -> None:
    """Each row: its chunk's address and true length (the kernels need nothing else)."""
    store = torch.zeros(1000, dtype=torch.uint8)
    spans = [store[16:116], store[0:0], store[160:192], store[240:241]]
    counts = [ch.num_chunks(s.numel(), 32) for s in spans]
    table = torch.empty((2, sum(counts)), dtype=torch.int64)
    chm._row_table(spans, counts, 32, table)
    base = store.data_ptr()
    assert table[0].tolist() == [base + 16 + 32 * k for k in range(4)] + [base + 160, base + 240]
    assert table[1].tolist() == [32, 32, 32, 4, 32, 1]


def _interpreter_path() -> str | None:
    """A PYTHONPATH under which Triton >= 3.9 imports (3.6's interpreter fails on loop bounds
    computed from kernel arguments): this environment's Triton, else the directories in
    GPUSNAP_TRITON_PATH (default: where GPU-less dev machines keep interpreter-only Triton
    packages, /tmp/tritonpkgs and /tmp/triton36)."""
    here = os.pathsep.join(p for p in sys.path if p)
    dirs = os.environ.get("GPUSNAP_TRITON_PATH", "/tmp/tritonpkgs:/tmp/triton36").split(os.pathsep)
    candidates = ([here] if importlib.util.find_spec("triton") else [])
    candidates += [os.pathsep.join([here, d]) for d in dirs if d and os.path.isdir(d)]
    probe = "import triton; print(tuple(int(v) for v in triton.__version__.split('.')[:2]) >= (3, 9))"
    for path in candidates:
        env = dict(os.environ, PYTHONPATH=path)
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        if done.stdout.strip() == "True":
            return path
    return None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the compiled kernels are tested instead")
def test_triton_interpreter_many_equals_per_span() -> None:
    """The many-span kernels, interpreted on CPU tensors, against the torch loop: both kernel
    shapes (whole chunks per tile; chunks streamed per period), several periods per chunk."""
    path = _interpreter_path()
    if path is None:
        pytest.skip("no Triton >= 3.9 importable (set GPUSNAP_TRITON_PATH)")
    script = textwrap.dedent(
        """
        import torch
        from gpusnap.kernels import chunk_hash as ch
        from gpusnap.kernels import chunk_hash_many as chm
        from tests.test_chunk_hash_many import per_span, varied_spans

        runs = [(1 << 16, 64, (2048, 8, True)), (1 << 16, 4096, (2048, 8, True)),
                (1 << 16, 4096, (256, 4, False)), (1 << 16, 16_400, (2048, 8, True)),
                (4, 96, (16, 1, False)), (4, 96, (16, 1, True)), (64, 4096, (256, 4, True))]
        for period, cs, config in runs:
            ch.PERIOD_PAIRS = period  # small periods: several per chunk, with tiny inputs
            store = torch.randint(0, 256, (13 * cs + 20_000,), dtype=torch.uint8)
            spans = varied_spans(store, cs)
            for order in (spans, spans[::-1]):
                want = per_span(order, cs)
                got = torch.full_like(want, -1)
                counts = [ch.num_chunks(s.numel(), cs) for s in order]
                chm._hash_triton_many(order, counts, cs, got, ch.TritonConfig(*config))
                assert torch.equal(got, want), (period, cs, config)
        print("interpreter ok")
        """
    )
    run_interpreted(script, path)


def run_interpreted(script: str, path: str) -> None:
    """Run ``script`` under Triton's interpreter (PYTHONPATH: the repository, then ``path``);
    it must print "interpreter ok"."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, path]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, check=False, cwd=root)
    assert "interpreter ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("chunk_size", [64, 4096, 1 << 20, (1 << 20) + 16, 4 << 20])
def test_triton_many_equals_per_span_on_cuda(chunk_size: int) -> None:
    store = torch.randint(0, 256, (13 * chunk_size + 20_000,), dtype=torch.uint8, device="cuda")
    spans = varied_spans(store, chunk_size)
    want = per_span(spans, chunk_size)
    out = empty_out(spans, chunk_size, torch.device("cuda"))
    torch.cuda.set_sync_debug_mode("error")  # the table upload must not make the host wait
    try:
        chunk_hashes_many(spans, chunk_size, out, impl="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, want)
    assert torch.equal(out.cpu(), per_span([s.cpu() for s in spans], chunk_size))


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_triton_many_offsets_past_2_gib() -> None:
    n, chunk = (2 << 30) + 12345, 4 << 20
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    spans = [data[: 1 << 20], data[(2 << 30) - 16 :], data[16:]]
    out = empty_out(spans, chunk, torch.device("cuda"))
    assert torch.equal(chunk_hashes_many(spans, chunk, out, impl="triton"), per_span(spans, chunk))


def _spans(store: torch.Tensor, sizes: list[int]) -> list[StorageSpan]:
    out, pos = [], 0
    for i, n in enumerate(sizes):
        out.append(StorageSpan(index=i, storage=store.untyped_storage(), device=store.device,
                               start=pos, end=pos + n, tensors=[store], paths=[f"t{i}"]))
        pos += n + 16
    return out


def test_hash_table_fill_many_equals_fill(device: torch.device) -> None:
    store = torch.randint(0, 256, (40_000,), dtype=torch.uint8, device=device)
    spans = _spans(store, [1000, 0, 64, 4097, 33, 8000, 5])
    one, many = HashTable(spans, 256), HashTable(spans, 256)
    for i, span in enumerate(spans):
        one.fill(i, span.as_bytes())
    many.fill_many(range(len(spans)), [s.as_bytes() for s in spans])  # one run of rows
    for device_table in one.tables:
        assert torch.equal(one.tables[device_table], many.tables[device_table])
    some = [0, 3, 4, 6]  # gaps: hashed into a temporary, then scattered
    gaps = HashTable(spans, 256)
    gaps.fill_many(some, [spans[i].as_bytes() for i in some])
    for i in range(len(spans)):
        expected = one.rows(i) if i in some else torch.zeros_like(one.rows(i))
        assert torch.equal(gaps.rows(i), expected), i
    with pytest.raises(ValueError, match="whole spans"):
        gaps.fill_many([3], [spans[3].as_bytes()[:100]])


def test_row_table_lists_every_chunk_address_and_length() -> None:
    """The table the Triton kernels read (built with NumPy on the host): row r is chunk k of
    its span at span start + k * chunk size, its length the chunk's true length."""
    chunk_size = 512
    store = torch.zeros(40 * chunk_size, dtype=torch.uint8)
    spans = varied_spans(store, chunk_size)
    counts = [ch.num_chunks(s.numel(), chunk_size) for s in spans]
    host = torch.full((2, sum(counts)), -1, dtype=torch.int64)
    chm._row_table(spans, counts, chunk_size, host)
    want = [(s.data_ptr() + k * chunk_size, min(chunk_size, s.numel() - k * chunk_size))
            for s, c in zip(spans, counts) for k in range(c)]
    assert list(zip(host[0].tolist(), host[1].tolist())) == want


def _packed(store: torch.Tensor, chunk_size: int, aligned: bool = True) -> tuple[list[int], list[int]]:
    """Offsets and sizes of varied spans in ``store`` (16-byte aligned starts unless not ``aligned``)."""
    sizes = [1, 15, 16, 17, 0, 4095, chunk_size - 1, chunk_size, chunk_size + 5, 3 * chunk_size + 13, 0, 4 * chunk_size]
    offsets, pos = [], 0 if aligned else 3
    for n in sizes:
        offsets.append(pos)
        pos += n + (-n % 16)
    assert pos <= store.numel()
    return offsets, sizes


@pytest.mark.parametrize("chunk_size", [16, 64, 4096])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_packed_equals_many(device: torch.device, chunk_size: int, aligned: bool) -> None:
    """chunk_hashes_packed hashes buffer[offsets[i]:offsets[i]+sizes[i]] exactly as
    chunk_hashes_many does the same spans as tensors (on CUDA with Triton: the packed row
    table; unaligned spans take the per-span path)."""
    store = torch.randint(0, 256, (20 * chunk_size + 4096,), dtype=torch.uint8, device=device)
    offsets, sizes = _packed(store, chunk_size, aligned)
    spans = [store[o : o + n] for o, n in zip(offsets, sizes)]
    want = per_span(spans, chunk_size)
    out = empty_out(spans, chunk_size, device)
    assert chunk_hashes_packed(store, offsets, sizes, chunk_size, out) is out
    assert torch.equal(out, want)
    if device.type == "cpu":
        assert torch.equal(chunk_hashes_packed(store, offsets, sizes, chunk_size, empty_out(spans, chunk_size, device),
                                               impl="torch"), want)


def test_packed_bad_arguments() -> None:
    store = torch.zeros(256, dtype=torch.uint8)
    out = torch.empty((1, 2), dtype=torch.int64)
    with pytest.raises(ValueError, match="within the buffer"):
        chunk_hashes_packed(store, [250], [16], 16, out)
    with pytest.raises(ValueError, match="one length"):
        chunk_hashes_packed(store, [0, 16], [16], 16, out)
    with pytest.raises(ValueError, match="out must be"):
        chunk_hashes_packed(store, [0], [32], 16, out)  # two rows
    with pytest.raises(TypeError):
        chunk_hashes_packed(store.view(torch.int8), [0], [16], 16, out)


def test_hash_table_fill_packed_equals_fill_many(device: torch.device) -> None:
    """A snapshot's spans hashed from its one buffer land in the same rows as fill_many's;
    spans whose rows are not contiguous in the table (a subset) take fill_many's path."""
    store = torch.randint(0, 256, (60_000,), dtype=torch.uint8, device=device)
    spans = _spans(store, [1000, 0, 64, 4097, 33, 8000, 5])
    buffer = torch.randint(0, 256, (30_000,), dtype=torch.uint8, device=device)
    offsets, pos = [], 0
    for s in spans:
        offsets.append(pos)
        buffer[pos : pos + s.nbytes] = s.as_bytes()
        pos += s.nbytes + (-s.nbytes % 16)
    many, packed = HashTable(spans, 256), HashTable(spans, 256)
    many.fill_many(range(len(spans)), [s.as_bytes() for s in spans])
    packed.fill_packed(range(len(spans)), buffer, offsets)
    for d in many.tables:
        assert torch.equal(many.tables[d], packed.tables[d])
    some = [0, 3, 4, 6]
    gaps = HashTable(spans, 256)
    gaps.fill_packed(some, buffer, [offsets[i] for i in some])
    for i in range(len(spans)):
        expected = many.rows(i) if i in some else torch.zeros_like(many.rows(i))
        assert torch.equal(gaps.rows(i), expected), i
