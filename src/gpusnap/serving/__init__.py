"""The resident restore server: ``gpusnap serve ROOT`` keeps a root's newest checkpoints in
page-locked host memory so that a fresh process restores at host-to-device speed
(docs/serve.md). ``server`` (life cycle, connections), ``holdings`` and ``held`` (what it
holds), ``request``, ``dests`` and ``cuda_runtime`` (one request's copies), ``connect``
(control requests). The client side, and what both share, is ``gpusnap.restore.via_server``."""

from gpusnap.restore.via_server.paths import socket_path
from gpusnap.serving.server import Server, ServerRunning, serve

__all__ = ["Server", "ServerRunning", "serve", "socket_path"]
