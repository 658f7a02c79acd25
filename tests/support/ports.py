"""Ports for servers a test starts."""

from __future__ import annotations

import itertools
import os
import socket

# Ports are handed out below the kernel's ephemeral range (32768-60999 on Linux), so no outgoing
# connection takes one between the look here and the server's bind; and each process of `make
# test`'s parallel pass (an xdist worker, or the stock path's pass beside them: no worker id) looks
# in a slice of its own, so two of them never hand out the same port. A process starts at a place
# of its own in its slice (its children inherit the worker id). What is handed out is checked free.
LOW, HIGH = 20_000, 32_768
SLICES = 8
_SIZE = (HIGH - LOW) // SLICES


def _slice() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    if worker.startswith("gw") and worker[2:].isdigit():
        return 1 + int(worker[2:]) % (SLICES - 1)
    return 0


_candidates = itertools.cycle(LOW + _slice() * _SIZE + (os.getpid() * 7919 + i) % _SIZE for i in range(_SIZE))


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that no other test process hands out."""
    for _ in range(_SIZE):
        port = next(_candidates)
        if _free(port):
            return port
    raise RuntimeError(f"no free port in {LOW + _slice() * _SIZE}-{LOW + (_slice() + 1) * _SIZE - 1}")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a port still in TIME_WAIT is passed over
        except OSError:
            return False
    return True


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
