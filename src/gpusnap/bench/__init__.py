"""``gpusnap bench``: gpusnap and its baselines measured side by side on real workloads.

Modules, top to bottom: ``runner`` (the suite), ``measure`` (step timing, stall, throughput),
``system`` (what a measured system implements), ``gpusnap_variants`` and ``baselines/*``
(the systems), ``driver_ckpt`` (the CUDA driver's process checkpoint on a child process),
``workloads`` and ``models`` (the programs), ``verify`` (bit-exactness), ``summary`` (first,
warm, ratios), ``env``, ``report`` and ``plots`` (the outputs). docs/bench.md defines every
figure.
"""

from gpusnap.bench.runner import BenchOptions, run_bench

__all__ = ["BenchOptions", "run_bench"]
