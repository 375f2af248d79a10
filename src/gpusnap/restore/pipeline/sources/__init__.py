"""Where a restore's bytes come from: a ``source.Source`` fills an owned ``Region`` with a batch.

``host_reads`` (reader threads), ``proc_reads`` (reader processes: ``reader_procs`` runs
``reader_worker``) and ``direct_reads`` (helper processes copying from the page cache onto
the device: ``direct_copies`` runs ``direct_worker``).
"""
