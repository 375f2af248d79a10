"""Restoring through the root's restore server (``Config.restore_from_server``), and what the
server (``gpusnap.serving``) shares with its clients.

``client`` asks the server and falls back; ``request`` says where each span's bytes go;
``connection``, ``protocol`` and ``paths`` are the socket, its wire format and where it
lies; ``cuda_ipc`` the CUDA calls both sides make themselves.
"""
