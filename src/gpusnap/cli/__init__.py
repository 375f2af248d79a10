"""The ``gpusnap`` command line: ls, show, verify, diff, du, gc, export, import, demo, bench, serve."""
