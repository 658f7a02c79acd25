"""The EDS service's bookkeeping of its streams, without a server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eds_server.transport.stream_table import AddressTable, StreamRegistry


@dataclass(eq=False)
class Listed:
    peer: str
    id: int = 0

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "peer": self.peer}


def test_addresses_count_every_stream_and_the_others_apart_and_forget_an_address_at_zero() -> None:
    table = AddressTable()
    table.add("10.0.0.1", 1)
    table.add("10.0.0.1", 1, other=True)
    table.add("10.0.0.2", 1, other=True)
    assert (table.held("10.0.0.1"), table.others("10.0.0.1"), table.others_total, len(table)) == (2, 1, 2, 2)
    table.add("10.0.0.2", -1, other=True)
    table.add("10.0.0.1", -1)
    assert (table.held("10.0.0.2"), table.others("10.0.0.2"), table.others_total, len(table)) == (0, 0, 1, 1)


def test_the_registry_gives_ids_in_opening_order_and_pages_by_them() -> None:
    registry: StreamRegistry[Listed] = StreamRegistry()
    streams = [Listed(f"10.0.0.{i % 2}:5{i}") for i in range(5)]
    for s in streams:
        registry.add(s)
    assert [s.id for s in streams] == [1, 2, 3, 4, 5] and len(registry) == 5 and streams[0] in registry
    registry.discard(streams[1])
    page = registry.describe(after=0, limit=2)
    assert [s["id"] for s in page["streams"]] == [1, 3] and page["total"] == 4 and page["next_after"] == 3
    last = registry.describe(after=3, limit=2)
    assert [s["id"] for s in last["streams"]] == [4, 5] and last["next_after"] is None
    assert {peer: [s.id for s in group] for peer, group in registry.by_peer().items()} == {
        "10.0.0.0:50": [1],
        "10.0.0.0:52": [3],
        "10.0.0.1:53": [4],
        "10.0.0.0:54": [5],
    }
