"""The pipelined loader: pieces of spans read from a source into reused host regions, checked,
and copied into their targets by one copy thread while the next pieces are read.

``loader`` runs it; ``schedule`` picks the next piece; ``staging`` owns the host regions;
``copier`` and ``device_check`` copy and verify on the device; ``warmup`` loads the hash
kernels early; ``stats`` says where the time went; ``sources/`` is where the bytes come from.
"""
