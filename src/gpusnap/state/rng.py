"""Random number generator state as a Stateful, so a restored run draws the same numbers.

Captured: torch's CPU generator, every CUDA device's generator (only when CUDA is already
initialized: capturing must not create a CUDA context a CPU-only program never asked for),
Python's :mod:`random` and NumPy's global generator (when NumPy is installed). The state_dict
holds only tensors and plain values, so it checkpoints without pickle.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["RNGState"]

try:
    import numpy as _np
except ImportError:  # NumPy is optional
    _np = None


class RNGState:
    """Stateful for the process's global random generators; put it in ``app_state``.

    ``load_state_dict`` restores each part present in the state (a checkpoint taken without
    CUDA restores fine on a GPU machine, and the reverse skips the CUDA part). CUDA states are
    restored for the devices both machines have.
    """

    def state_dict(self) -> dict[str, Any]:
        """The generators' states now: torch CPU, every initialized CUDA device, Python's `random`, NumPy's."""
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        if _np is not None:
            state["numpy"] = _numpy_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the generators to ``state_dict`` (what :meth:`state_dict` returned), those it holds."""
        if "torch" in state_dict:
            torch.set_rng_state(_byte_tensor(state_dict["torch"]))
        if "python" in state_dict:
            random.setstate(_as_tuples(state_dict["python"]))
        if "cuda" in state_dict and torch.cuda.is_available():
            for index, cuda_state in enumerate(state_dict["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(_byte_tensor(cuda_state), index)
        if "numpy" in state_dict and _np is not None:
            _set_numpy_state(state_dict["numpy"])


def _byte_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Generators take a contiguous CPU uint8 tensor; a restored one may live elsewhere."""
    return tensor.detach().to(device="cpu", dtype=torch.uint8).contiguous()


def _as_tuples(value: Any) -> Any:
    """random.setstate wants tuples all the way down; a checkpoint may hand back lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


def _numpy_state() -> dict[str, Any]:
    algorithm, keys, pos, has_gauss, cached_gaussian = _np.random.get_state(legacy=True)
    return {
        "algorithm": str(algorithm),
        "keys": torch.from_numpy(keys.astype(_np.int64)),  # uint32 words, widened exactly
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _set_numpy_state(state: dict[str, Any]) -> None:
    keys = state["keys"].detach().cpu().numpy().astype(_np.uint32)
    _np.random.set_state(
        (state["algorithm"], keys, int(state["pos"]), int(state["has_gauss"]), float(state["cached_gaussian"]))
    )
