"""Find out before starting anything whether the addresses we are asked to listen on can be bound,
so a taken port is reported with the flag that named it, before any "serving" line."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterable


def unbindable(addresses: Iterable[tuple[str, tuple[str, int] | None]]) -> str | None:
    """The first `(what, (host, port))` that cannot be bound, as `"WHAT HOST:PORT: reason"`, else None.

    Binds as asyncio's servers do (SO_REUSEADDR, every address the host resolves to) and holds each
    socket until all are tried, so two flags naming one port are caught too. Port 0 is skipped. It
    is a check, not a reservation: a port taken just after it still fails at start, less clearly.
    """
    with contextlib.ExitStack() as held:
        for what, address in addresses:
            if address is None or address[1] == 0:
                continue
            host, port = address
            shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            try:
                infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            except socket.gaierror as e:
                return f"{what} {shown}: cannot resolve {host!r} ({e.strerror})"
            for family, kind, proto, _, sockaddr in infos:
                sock = held.enter_context(socket.socket(family, kind, proto))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    sock.bind(sockaddr)
                    sock.listen(1)  # a listening socket: a second bind to it fails, even with SO_REUSEADDR
                except OSError as e:
                    reason = "address in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
                    return f"{what} {shown}: {reason}"
    return None
