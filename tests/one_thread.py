"""torch on one CPU thread for a block, the process's count restored after it: a trainer that
set it for good left every later test of the session on one thread (a CPU matmul's sums are
split by thread, so their last bits then differed from a process that runs with more)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
