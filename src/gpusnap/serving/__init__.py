"""The resident restore server: ``gpusnap serve ROOT`` keeps a root's newest checkpoints in
page-locked host memory so that a fresh process restores at host-to-device speed
(docs/serve.md). The client side is ``gpusnap.restore.server_client``."""

from gpusnap.serving.paths import socket_path
from gpusnap.serving.server import Server, ServerRunning, serve

__all__ = ["Server", "ServerRunning", "serve", "socket_path"]
