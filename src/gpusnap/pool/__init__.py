"""The warm process pool (docs/pool.md): processes that have imported torch and the entry's
module, created their CUDA context, built the model empty and warmed its kernels, waiting to
be handed a checkpoint's weights.

``pool`` (:class:`Pool`: start, take, replace, close), ``child`` (the pool's side of one
process), ``handle`` (:class:`PoolProcess`, :class:`Exited`), ``entry`` (the :func:`entry`
decorator; naming and finding entries), ``worker`` and ``warm`` (one process: start, load,
serve), ``ready`` (:class:`Ready`), ``messages`` (what pool and process say), ``faults``
(a test hook), ``serve`` (``gpusnap serve ROOT --pool N``), ``remote`` (:func:`take_from`
its pool).

>>> with gpusnap.pool.Pool(root, "my_server:serve", size=2) as pool:   # doctest: +SKIP
...     proc = pool.take()             # the newest checkpoint's weights, into a warm model
"""

from gpusnap.pool.entry import entry
from gpusnap.pool.handle import Exited, PoolProcess
from gpusnap.pool.messages import PoolError
from gpusnap.pool.pool import Pool
from gpusnap.pool.ready import Ready
from gpusnap.pool.remote import Handed, take_from

__all__ = ["Exited", "Handed", "Pool", "PoolError", "PoolProcess", "Ready", "entry", "take_from"]
