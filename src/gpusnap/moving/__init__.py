"""Moving a job (DESIGN.md, "Moving a job"): suspend and resume a state in place.

``suspend(app_state)`` (``suspend.py``, its call order in the module docstring) finds every
tensor the state reaches (``reach.py``), groups them by storage and checks them
(``members.py``, ``graphs.py``), copies their bytes to one page-locked host slab
(``host_memory.py``, ``copies.py``) and points each storage at its bytes there
(``swap.py``), which frees the device memory (``device_memory.py`` measures it). The
``Suspended`` handle (``suspended.py``) resumes eagerly, or lazily through the lazy
restore's gate (``lazy_resume.py``); ``registry.py`` keeps the host bytes alive while any
storage points at them. See docs/moving.md.
"""

from __future__ import annotations

from gpusnap.moving.host_memory import release_host_memory
from gpusnap.moving.stats import SuspendStats
from gpusnap.moving.suspend import suspend
from gpusnap.moving.suspended import Suspended

__all__ = ["SuspendStats", "Suspended", "release_host_memory", "suspend"]
