"""CUDA graphs and a suspend: a graph replays its kernels at the addresses it captured.

After a suspend those addresses are freed (and may be handed to other tensors, or another
process); after a resume the state lives at new ones. A replay of a graph captured before
the suspend would read and write memory that is no longer the state's. That is the
program's to handle (capture again after ``resume()``); what gpusnap can see, it refuses
rather than let a replay run over freed memory:

- a ``torch.cuda.CUDAGraph`` reachable from ``app_state`` (``reach`` reports them);
- CUDA graphs recorded by ``torch.compile(mode="reduce-overhead")`` (inductor's CUDA graph
  trees) on a device being suspended: they hold the parameters' addresses.

``allow_cuda_graphs=True`` lets the suspend go on: the program promises to capture (or
``torch._inductor.cudagraph_trees.reset_cudagraph_trees()``) again before its next replay.
Graphs gpusnap cannot see (``make_graphed_callables``, graphs held outside app_state, other
libraries' graphs) are the program's responsibility either way.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from gpusnap.errors import CheckpointError

__all__ = ["refuse_graphs"]


def refuse_graphs(graph_paths: Sequence[str], devices: Sequence[torch.device]) -> None:
    """CheckpointError if a CUDA graph could replay over the suspended state's memory."""
    if graph_paths:
        shown = ", ".join(graph_paths[:4]) + (f" (+{len(graph_paths) - 4} more)" if len(graph_paths) > 4 else "")
        raise CheckpointError(
            f"cannot suspend: app_state holds CUDA graphs ({shown}); a replay after suspend() or resume() would run "
            f"its kernels over memory that is no longer the state's. Drop them (graph.reset()) and capture again "
            f"after resume(), or pass allow_cuda_graphs=True if the program does so itself. Nothing was moved"
        )
    trees = _devices_with_graph_trees()
    hit = [d for d in devices if d.type == "cuda" and (d.index if d.index is not None else 0) in trees]
    if hit:
        raise CheckpointError(
            f"cannot suspend: torch.compile(mode='reduce-overhead') recorded CUDA graphs on {hit[0]}, which replay at "
            f"the parameters' current addresses. Call torch._inductor.cudagraph_trees.reset_cudagraph_trees() first "
            f"(they are recorded again at the next calls after resume()), or pass allow_cuda_graphs=True. Nothing "
            f"was moved"
        )


def _devices_with_graph_trees() -> set[int]:
    """Device indices on which inductor's CUDA graph trees hold recorded graphs (this thread's
    trees: torch keeps them per thread, shared with autograd's threads)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or not torch._C._is_key_in_tls("tree_manager_containers"):
        return set()
    try:
        containers = trees.get_obj(trees.local, "tree_manager_containers")
    except (AttributeError, RuntimeError):  # (a torch whose internals differ: nothing to tell)
        return set()
    return {int(index) for index, c in dict(containers).items() if getattr(c, "tree_manager", None) is not None}
