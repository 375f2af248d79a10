"""``python -m gpusnap`` is the ``gpusnap`` command."""

from gpusnap.cli.main import main

raise SystemExit(main())
