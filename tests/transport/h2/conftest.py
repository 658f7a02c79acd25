"""Fixtures shared by the fast path's read tests (direct and early requests)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from eds_server.transport.grpc import StreamSession


@pytest.fixture
def handled(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], list[bytes]]:
    """The requests every session handled, in order (by either path); called with a node id: that
    stream's."""
    seen: list[tuple[StreamSession, bytes]] = []
    original = StreamSession.receive

    def spy(self: StreamSession, data: bytes, first: bool) -> None:
        seen.append((self, bytes(data)))
        original(self, data, first)

    monkeypatch.setattr(StreamSession, "receive", spy)
    return lambda node: [d for s, d in seen if s.node == node]
