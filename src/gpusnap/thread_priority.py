"""Background work at the lowest CPU priority, so the program's own threads go first.

A promotion hashes every byte it copies on the host (BLAKE2b, and the device hash check),
tens of CPU-seconds per 10 GB; run beside training at the same priority, its threads took
cores from the thread that launches the program's kernels (and from its data loaders): a
promoted Llama checkpoint cost training 10.4 s (BENCHMARKS.md). At nice 19 the scheduler
gives them what the program leaves idle. Linux applies ``setpriority`` to one thread when
given its thread id; threads it then starts (a torch intra-op pool made from it) inherit the
priority.

>>> import threading
>>> t = threading.Thread(target=lower_this_thread); t.start(); t.join()
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["LOWEST", "lower_this_thread"]

LOWEST = 19
log = logging.getLogger("gpusnap")


def lower_this_thread() -> bool:
    """Give the calling thread the lowest CPU priority; False where the OS does not allow it
    per thread (not Linux) or refuses (the work then runs at the program's priority)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST)
    except OSError as exc:
        log.debug("gpusnap: could not lower the priority of thread %s: %s", threading.current_thread().name, exc)
        return False
    return True
