"""gpusnap copies on streams of its own, never on torch's pooled streams: one of those may be
the stream the program captures a CUDA graph on (``torch.cuda.graph``'s default capture
stream comes from the same pool), and a copy or event of a save there broke the program's
capture once the pool had wrapped around."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gpusnap
from gpusnap.device import OWN_STREAMS, own_stream


@pytest.mark.cuda
def test_own_streams_are_none_of_the_pooled_ones() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    low, _high = torch.cuda.Stream.priority_range()
    mine = [own_stream(device, p).cuda_stream for p in (0, low) for _ in range(OWN_STREAMS)]
    pooled = {torch.cuda.Stream(device, priority=p).cuda_stream for p in (0, low) for _ in range(80)}
    assert not set(mine) & pooled
    handed = [own_stream(device, low) for _ in range(OWN_STREAMS + 1)]
    assert len({s.cuda_stream for s in handed[:OWN_STREAMS]}) == OWN_STREAMS, "handed out in turn"
    assert handed[-1] is handed[0], "then again, round-robin: a bounded number"


@pytest.mark.cuda
def test_a_graph_captured_on_any_pooled_stream_while_a_save_copies(tmp_path: Any) -> None:
    """Each pooled stream of the copy stream's priority in turn captures a graph while a save
    copies: with gpusnap's copies on a pooled stream, the capture on that very stream failed
    (the save with "CUDA error: invalid argument")."""
    low, _high = torch.cuda.Stream.priority_range()
    x = torch.zeros(1 << 16, device="cuda")
    state = {"big": torch.randn(1 << 22, device="cuda"), "x": x}
    config = gpusnap.Config(chunk_size=1 << 16, staging_bytes=1 << 20, fsync=False, io_threads=2,
                            cow_budget_bytes=1 << 30)
    with gpusnap.Checkpointer(tmp_path / "ck", config=config) as ck:
        ck.save(state).wait()  # (its copy stream exists from here on)
        for _ in range(33):  # every pooled stream of that priority (32 a device) at least once
            expected = {k: v.clone() for k, v in state.items()}
            pending = ck.save(state)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(priority=low)):
                x.add_(1)  # recorded, not run
            info = pending.wait()
        got = {k: torch.empty_like(v) for k, v in state.items()}
        ck.restore(got, info.id)
    for k in state:
        assert torch.equal(got[k], expected[k]), k
