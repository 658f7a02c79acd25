"""What the EDS service keeps of its open streams, apart from serving them: the streams themselves
(for /v1/streams, shutdown and shedding) and how many each client address holds (for the per-IP
share of --max-streams). Plain bookkeeping, no IO: the service decides, these only count.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar


class ListedStream(Protocol):
    """What the registry reads of a stream."""

    id: int
    peer: str

    def describe(self) -> dict[str, Any]: ...


class AddressTable:
    """Open streams of each client IP: of every service (`held`), and of health, reflection and
    fetch alone (`others`). An address with none is not kept, so the table stays as small as the
    set of connected clients."""

    __slots__ = ("_all", "_others", "others_total")

    def __init__(self) -> None:
        self._all: dict[str, int] = {}
        self._others: dict[str, int] = {}
        self.others_total = 0  # open health, reflection and fetch streams, of every address

    def held(self, ip: str) -> int:
        return self._all.get(ip, 0)

    def others(self, ip: str) -> int:
        return self._others.get(ip, 0)

    def add(self, ip: str, n: int, *, other: bool = False) -> None:
        """Count `n` more (or fewer, if negative) streams of `ip`; `other`: health, reflection, fetch."""
        _count(self._all, ip, n)
        if other:
            _count(self._others, ip, n)
            self.others_total += n

    def __len__(self) -> int:
        return len(self._all)


def _count(table: dict[str, int], ip: str, n: int) -> None:
    held = table.get(ip, 0) + n
    if held:
        table[ip] = held
    else:
        del table[ip]


S = TypeVar("S", bound=ListedStream)


class StreamRegistry(Generic[S]):
    """The open xDS streams, each with an id that grows with opening order."""

    def __init__(self) -> None:
        self._streams: set[S] = set()
        self.opened = 0  # streams ever added: the last id given

    def add(self, stream: S) -> None:
        self.opened += 1
        stream.id = self.opened
        self._streams.add(stream)

    def discard(self, stream: S) -> None:
        self._streams.discard(stream)

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[S]:
        return iter(self._streams)

    def __contains__(self, stream: object) -> bool:
        return stream in self._streams

    def by_peer(self) -> dict[str, list[S]]:
        """The streams of each connection (peer address and port)."""
        out: dict[str, list[S]] = {}
        for stream in self._streams:
            out.setdefault(stream.peer, []).append(stream)
        return out

    def describe(self, after: int = 0, limit: int = 100) -> dict[str, Any]:
        """One page of /v1/streams: the `limit` oldest streams opened after stream `after`.

        Bounded however many streams and names there are (each stream shows at most
        xds.session.STREAM_NAMES_SHOWN names), so answering never holds up the event loop for long.
        """
        page = heapq.nsmallest(limit + 1, (s for s in self._streams if s.id > after), key=lambda s: s.id)
        more = len(page) > limit
        page = page[:limit]
        return {
            "streams": [s.describe() for s in page],
            "total": len(self._streams),
            "next_after": page[-1].id if more else None,
        }
