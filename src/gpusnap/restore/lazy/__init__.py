"""Lazy restore: the program runs while the loader works, and each op waits only for the
spans it touches.

``lazy_restore`` is one such restore; ``gate`` the dispatch mode that holds ops back;
``doors`` the reads of a tensor's bytes no ATen op shows. Every live one is registered in
``gpusnap.restore.active``.
"""
