"""Trainer plug-ins: gpusnap under Lightning, the Hugging Face ``Trainer`` and accelerate.

``import gpusnap`` never imports a framework; each submodule imports its own when it is
imported, and a missing one is an ImportError naming the extra that installs it:

- :mod:`gpusnap.integrations.lightning`: ``GpusnapCheckpointIO`` (``pip install 'gpusnap[lightning]'``)
- :mod:`gpusnap.integrations.transformers`: ``GpusnapCallback`` (``'gpusnap[transformers]'``)
- :mod:`gpusnap.integrations.accelerate`: ``accelerator_state`` (``'gpusnap[accelerate]'``)

One page per integration: ``docs/integrations/``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` for the integration ``extra``, or say which extra installs it.

    >>> require("gpusnap_no_such_framework", "lightning")
    Traceback (most recent call last):
    ImportError: gpusnap.integrations.lightning needs the package 'gpusnap_no_such_framework': pip install 'gpusnap[lightning]'
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"gpusnap.integrations.{extra} needs the package {module!r}: pip install 'gpusnap[{extra}]'"
        ) from exc
