"""Find out before starting anything whether the addresses we are asked to listen on can be bound,
so a taken port is reported with the flag that named it, before any "serving" line."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterable


def unbindable(addresses: Iterable[tuple[str, tuple[str, int] | None]]) -> str | None:
    """The first of `every_unbindable`, or None."""
    found = every_unbindable(addresses, first_only=True)
    return found[0] if found else None


def free_ports(host: str, n: int) -> list[int]:
    """`n` distinct ports the OS says are free on `host` now (held together while chosen, so they
    differ). Like `unbindable`, a check: another program may take one before it is bound."""
    with contextlib.ExitStack() as held:
        found = []
        for _ in range(n):
            sock = held.enter_context(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET))
            sock.bind((host, 0))
            found.append(int(sock.getsockname()[1]))
        return found


def every_unbindable(addresses: Iterable[tuple[str, tuple[str, int] | None]], first_only: bool = False) -> list[str]:
    """Each `(what, (host, port))` that cannot be bound, as `"WHAT HOST:PORT: reason"`: all of them,
    so that a user moving one busy port learns of the next at once.

    Binds as asyncio's servers do (SO_REUSEADDR, every address the host resolves to) and holds each
    socket until all are tried, so two flags naming one port are caught too. A host name that does
    not resolve is named with its flag, port 0 included (whose bind is skipped). It is a check, not
    a reservation: a port taken just after it still fails at start, less clearly.
    """
    problems: list[str] = []
    with contextlib.ExitStack() as held:
        for what, address in addresses:
            if problems and first_only:
                break
            if address is None:
                continue
            host, port = address
            shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            try:
                infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            except socket.gaierror as e:
                problems.append(f"{what} {shown}: cannot resolve {host!r} ({e.strerror})")
                continue
            if port == 0:
                continue
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
                    problems.append(f"{what} {shown}: {reason}")
                    break
    return problems
