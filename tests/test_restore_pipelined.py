"""Pipelined eager restore: chunks stream through host slots into the targets, in place."""

from __future__ import annotations

import random
import threading
import types
from pathlib import Path

import pytest
import torch
from restore_support import held_root, log_ranges, tiny_config
from torch import nn

import gpusnap
from gpusnap import CheckpointError, IntegrityError
from gpusnap.restore import restorer as restorer_mod
from gpusnap.restore.apply_bytes import apply_range, apply_span
from gpusnap.restore.pipeline.loader import Loader
from gpusnap.restore.pipeline.staging import SlotPool
from gpusnap.state import SpanInfo, flatten, plan_restore
from gpusnap.storage.repository import Repository

MODES = ["upfront", "stream", "off"]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight  # tied: one storage
        self.norm = nn.LayerNorm(16)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(ids))) * self.scale


def _state(device: torch.device | str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    base = torch.randn(40, 30, generator=g).to(device)
    state = {
        "tied": Tied().to(device),
        "transposed": torch.randn(30, 40, generator=g).to(device).t(),  # stored whole-span
        "base": base,
        "row": base[3],  # a view sharing base's storage
        "strided": torch.randn(64, generator=g).to(device)[::3],
        "bf16": torch.randn(333, generator=g).to(device, torch.bfloat16),
        "i8": torch.randint(-128, 127, (1000,), generator=g, dtype=torch.int8).to(device),
        "bool": (torch.randn(777, generator=g) > 0).to(device),
        "c64": torch.randn(100, generator=g, dtype=torch.complex64).to(device),
        "f64": torch.randn(2000, generator=g, dtype=torch.float64).to(device),
        "empty": torch.empty(0, device=device),
        "step": seed,
    }
    state["optim"] = torch.optim.SGD(state["tied"].parameters(), lr=0.1, momentum=0.9)
    state["tied"](torch.tensor([1, 2, 3], device=device)).sum().backward()
    state["optim"].step()
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    out.update({f"tied.{k}": v for k, v in state["tied"].state_dict().items()})
    for i, s in enumerate(state["optim"].state.values()):
        out.update({f"optim.{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


@pytest.mark.parametrize("verify", MODES)
def test_roundtrip_every_layout_in_place(tmp_path, device, verify):
    source = _state(device, 0)
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save(source, blocking=True)
        target = _state(device, 1)
        target["optim"] = torch.optim.SGD(target["tied"].parameters(), lr=0.1, momentum=0.9)  # no state yet
        target["row"] = target["base"][3]
        ptrs = {k: v.data_ptr() for k, v in _tensors(target).items()}
        handle = ck.restore(target, verify=verify)
    assert handle.stats["verify"] == verify and handle.done()
    assert target["step"] == 0
    assert target["tied"].head.weight is target["tied"].emb.weight
    got, want = _tensors(target), _tensors(source)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(_bits(got[k]), _bits(want[k])), k
    for k, ptr in ptrs.items():
        assert got[k].data_ptr() == ptr, f"{k} moved"
    assert target["row"].data_ptr() == target["base"][3].data_ptr()


def test_streamed_and_whole_spans_are_told_apart():
    state = {"plain": torch.zeros(10), "t": torch.zeros(4, 5).t(), "s": torch.zeros(9)[::2], "e": torch.empty(0)}
    flat = flatten(state)
    plan = plan_restore(state, flat.tree, [SpanInfo(s.nbytes, str(s.device)) for s in flat.spans])
    kinds = {flat.spans[i].paths[0]: plan.streamable(i) for i in range(len(flat.spans))}
    assert kinds == {"plain": True, "t": False, "s": False, "e": True}


def test_apply_range_in_any_order_from_many_threads():
    source = {"a": torch.randn(1000), "b": torch.randn(3, 7)}
    flat = flatten(source)
    data = {s.index: s.as_bytes().clone() for s in flat.spans}
    target = {"a": torch.zeros(1000), "b": torch.zeros(3, 7)}
    plan = plan_restore(target, flat.tree, [SpanInfo(s.nbytes, "cpu") for s in flat.spans])
    pieces = [(i, off, min(off + 37, d.numel())) for i, d in data.items() for off in range(0, d.numel(), 37)]
    random.Random(0).shuffle(pieces)
    threads = [
        threading.Thread(target=lambda chunk=pieces[k::4]: [apply_range(plan, i, a, data[i][a:b]) for i, a, b in chunk])
        for k in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not plan.pending_spans
    assert torch.equal(target["a"], source["a"]) and torch.equal(target["b"], source["b"])
    with pytest.raises(CheckpointError, match="already applied"):
        apply_range(plan, 0, 0, data[0][:4])
    fresh = plan_restore(target, flat.tree, [SpanInfo(s.nbytes, "cpu") for s in flat.spans])
    with pytest.raises(CheckpointError, match="outside"):
        apply_range(fresh, 0, 3990, data[0][:20])
    apply_range(fresh, 0, 0, data[0][:4000])
    with pytest.raises(CheckpointError, match="already applied"):
        apply_span(fresh, 0, data[0])


def _corrupt_last_chunk(root: Path, tensor: torch.Tensor) -> None:
    last = tensor.numpy().tobytes()[-512:]
    for pack in (root / "packs").rglob("*.pack"):
        data = bytearray(pack.read_bytes())
        at = data.find(last)
        if at >= 0:
            data[at + 5] ^= 0x10
            pack.write_bytes(bytes(data))
            return
    raise AssertionError("chunk not found")


def test_corrupt_chunk_stream_names_what_was_written(tmp_path):
    root = tmp_path / "ck"
    source = {"big": torch.arange(8192.0)}  # 64 chunks; the last one is corrupt
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.save(source, blocking=True)
    _corrupt_last_chunk(root, source["big"])
    target = {"big": torch.zeros(8192)}
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        with pytest.raises(IntegrityError, match="big") as err:
            ck.restore(target, verify="stream")
        assert "partly written: tensor big" in str(err.value)
        assert target["big"][:10].eq(torch.arange(10.0)).all(), "earlier chunks were applied"
        assert target["big"][-128:].eq(0).all(), "the corrupt chunk never landed"
        target["big"].zero_()
        with pytest.raises(IntegrityError, match="big") as err:
            ck.restore(target, verify="upfront")
        assert "partly" not in str(err.value)
        assert target["big"].eq(0).all(), "verify-first leaves the targets untouched"
        with pytest.raises(IntegrityError):
            ck.restore(target)  # auto: small, so verified up front
        assert target["big"].eq(0).all()


def test_auto_streams_large_checkpoints(tmp_path, monkeypatch):
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save({"t": torch.ones(1000)}, blocking=True)
        assert ck.restore({"t": torch.zeros(1000)}).stats["verify"] == "upfront"
        monkeypatch.setattr(restorer_mod, "AUTO_UPFRONT_BYTES", 100)
        target = {"t": torch.zeros(1000)}
        handle = ck.restore(target)
    assert handle.stats["verify"] == "stream" and target["t"].eq(1).all()
    assert handle.stats["bytes_read"] == 4000 and handle.stats["chunks_read"] == 8


def test_bad_arguments(tmp_path):
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save({"t": torch.ones(4)}, blocking=True)
        with pytest.raises(ValueError, match="verify"):
            ck.restore({"t": torch.zeros(4)}, verify="maybe")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="lazy"):
            ck.restore({"t": torch.zeros(4)}, lazy=True, verify="upfront")


def test_read_errors_stop_the_stream_and_are_raised(tmp_path, monkeypatch):
    import errno

    with (

        held_root(tmp_path / "ck", monkeypatch) as backend,

        gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck,

    ):
        ck.save({"t": torch.ones(4096)}, blocking=True)
        backend.read_errno = errno.EIO
        with pytest.raises(gpusnap.StorageError):
            ck.restore({"t": torch.zeros(4096)}, verify="stream")
        backend.read_errno = None
        target = {"t": torch.zeros(4096)}
        ck.restore(target, verify="stream")
    assert target["t"].eq(1).all()


def test_loader_follows_the_order_with_one_reader(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    source = {f"t{i}": torch.full((256,), float(i)) for i in range(6)}  # 2 chunks each
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        manifest_id = ck.save(source, blocking=True).wait().id
    repo = Repository.open(root)
    manifest = repo.load_manifest(manifest_id)
    target = {k: torch.zeros(256) for k in source}
    spans = [SpanInfo(e.nbytes, e.device) for e in manifest.storages]
    plan = plan_restore(target, manifest.tree, spans)
    seen: list[int] = []
    log_ranges(monkeypatch, seen.append)
    order = [4, 1, 5, 0, 3, 2]
    loader = Loader(
        repo, manifest, plan, order=order, threads=1, slots=SlotPool(2, 512, pinned=False), streams={}, verify=True
    )
    loader.start()
    loader.wait()
    assert seen == [i for i in order for _ in range(2)]
    plan.finish()
    for k, v in source.items():
        assert torch.equal(target[k], v)


def test_load_order_uses_the_recorded_access_order():
    manifest = types.SimpleNamespace(storages=[None] * 5, stats={"access_order": [3, 3, 99, "x", 1]})
    plan = types.SimpleNamespace(read_at_finish=frozenset({4}))
    assert restorer_mod.load_order(manifest, plan) == ([4, 3, 1, 0, 2], "access")  # type: ignore[arg-type]
    manifest.stats = {}
    assert restorer_mod.load_order(manifest, plan) == ([4, 0, 1, 2, 3], "manifest")  # type: ignore[arg-type]


def test_host_regions_are_no_more_than_the_checkpoint_fills_and_grow_for_a_bigger_one(tmp_path):
    root = tmp_path / "ck"
    config = tiny_config(staging_bytes=0, restore_piece_bytes=8 * 512)  # 4 KiB regions, no staging cap
    with gpusnap.Checkpointer(root, config=config) as ck:
        restorer = ck._restorer
        ck.save({"t": torch.ones(1024)}, tag="small", blocking=True)  # 4 KiB: one region's worth
        ck.save({"t": torch.ones(1024), "big": torch.ones(1 << 18)}, tag="big", blocking=True)  # 1 MiB
        ck.restore({"t": torch.zeros(1024)}, "small", verify="stream")
        small = restorer._slots
        assert small.slots == 1 + restorer_mod.EXTRA_REGIONS, "a tiny checkpoint needs one region per piece"
        target = {"t": torch.zeros(1024), "big": torch.zeros(1 << 18)}
        ck.restore(target, "big", verify="stream")
        assert restorer._slots is not small and restorer._slots.slots > small.slots
        assert restorer._slots.slots <= restorer.threads + restorer_mod.EXTRA_REGIONS
        assert torch.equal(target["big"], torch.ones(1 << 18))
        grown = restorer._slots
        ck.restore({"t": torch.zeros(1024)}, "small", verify="stream")
        assert restorer._slots is grown, "a smaller restore reuses the bigger pool"


def test_staging_slots_are_reused_and_grown_for_bigger_chunks(tmp_path):
    root = tmp_path / "ck"
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.save({"t": torch.ones(4096)}, blocking=True)
        ck.restore({"t": torch.zeros(4096)}, verify="stream")
        pool = ck._restorer._slots
        ck.restore({"t": torch.zeros(4096)}, verify="stream")
        assert ck._restorer._slots is pool
    with gpusnap.Checkpointer(root, config=tiny_config(chunk_size=1024)) as ck:
        ck.save({"t": torch.full((4096,), 2.0)}, blocking=True)
        target = {"t": torch.zeros(4096)}
        ck.restore(target, verify="stream")
        ck.restore(target, ck.list()[0].id, verify="stream")  # 512-byte chunks fit 1024-byte slots
    assert target["t"].eq(1).all()


def test_read_at_finish_excludes_optimizers_but_not_rng_or_extra_state():
    class Extra(nn.Linear):
        def get_extra_state(self) -> dict:
            return {"tensor": torch.arange(3.0)}

        def set_extra_state(self, state: dict) -> None:
            self.seen = state["tensor"].tolist()

    model = Extra(2, 2)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    state = {"model": model, "optim": optim, "rng": gpusnap.RNGState()}
    flat = flatten(state)
    plan = plan_restore(state, flat.tree, [SpanInfo(s.nbytes, "cpu") for s in flat.spans])
    paths = {p for i in plan.read_at_finish for p in plan.span_paths[i]}
    assert any(p.startswith("rng/") for p in paths)
    assert any("_extra_state" in p for p in paths)
    assert not any(p.startswith(("optim/", "model/weight", "model/bias")) for p in paths)


@pytest.mark.cuda
def test_cuda_graph_captured_before_restore_replays_restored_weights(tmp_path):
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    target = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    static_x = torch.randn(16, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        target(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = target(static_x)
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save({"model": source}, blocking=True)
        for verify in ("stream", "upfront"):
            with torch.no_grad():
                for p in target.parameters():
                    p.zero_()
            ck.restore({"model": target}, verify=verify)
            graph.replay()
            with torch.no_grad():
                assert torch.equal(static_out, source(static_x)), verify


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("verify", ["stream", "off"])
def test_restore_called_inside_inference_mode(tmp_path, lazy, verify):
    """A serving loop restores under torch.inference_mode(): the aliases the restore writes
    through are built on the calling thread, and must not become inference tensors there
    (the copy thread and the readers, outside the mode, could not write them)."""
    source = {"w": torch.randn(4096), "lin": nn.Linear(64, 64)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save(source, blocking=True)
        target = {"w": torch.zeros(4096), "lin": nn.Linear(64, 64)}
        with torch.inference_mode():
            handle = ck.restore(target, verify=verify, lazy=lazy)
            handle.wait()
            assert torch.equal(target["w"], source["w"])
            assert torch.equal(target["lin"].weight, source["lin"].weight)
