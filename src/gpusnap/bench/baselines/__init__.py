"""The baselines gpusnap is measured against, one module per family.

- :mod:`.torch_save`: ``torch.save`` of the state's tensors, to tmpfs and to disk, fsynced.
- :mod:`.dcp`: ``torch.distributed.checkpoint.save`` and ``async_save`` with ``DefaultStager``.
- :mod:`.pinned_copy`: a stop-the-world copy into preallocated pinned host buffers.
- :mod:`.cuda_driver`: the CUDA driver's process checkpoint API on a child process.
"""
