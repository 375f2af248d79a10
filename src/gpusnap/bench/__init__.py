"""``gpusnap bench``: gpusnap and its baselines measured side by side on real workloads.

Modules, top to bottom: ``runner`` (the suite), ``measure`` (step timing, stall, throughput),
``system`` (what a measured system implements), ``gpusnap_variants`` and ``baselines/*``
(the systems), ``driver_ckpt`` (the CUDA driver's process checkpoint on a child process),
``workloads`` and ``models`` (the programs), ``verify`` (bit-exactness), ``summary`` (first,
warm, ratios), ``env``, ``report`` and ``plots`` (the outputs). docs/bench.md defines every
figure.

``gpusnap bench --cost`` (what each checkpoint costs a training job): ``cost_runner`` (the
suite; its docstring has the commands), ``cost`` (the windows and their arithmetic),
``cost_throughput`` (every N), ``cost_summary`` (first, warm, ratios to the baseline),
``cost_report``; its rows: ``gpusnap_tiers``, ``baselines/pinned_writer``,
``baselines/torch_save_thread``, ``baselines/dcp``; its new workload: ``llama``.
"""

from gpusnap.bench.runner import BenchOptions, run_bench

__all__ = ["BenchOptions", "run_bench"]
