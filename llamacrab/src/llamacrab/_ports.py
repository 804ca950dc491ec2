"""A free TCP port, for a child process or an RPC worker to listen on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now. Another process may take it before the
    caller binds it: the callers' own start-up checks report that as a failed start."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
