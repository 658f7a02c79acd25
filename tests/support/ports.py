"""Ports for servers a test starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (may race with other processes, rarely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bindable(port: int) -> bool:
    """Whether a new server could listen on 127.0.0.1:`port` now (nothing holds it)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
        except OSError:
            return False
    return True
