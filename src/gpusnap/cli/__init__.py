"""The ``gpusnap`` command line: ls, show, verify, gc, demo, bench."""
