"""An HPACK decoder that answers a header block repeating the last one from memory.

Envoy's gRPC client opens one stream per EDS cluster, and every stream after a connection's first
sends the same 57-byte block: its fields indexed in the dynamic table, :path a Huffman literal that
is never added to it. hpack decodes those bytes against the same table to the same list each time,
23 us a stream in pure Python (most of it the Huffman code of :path). Here the last block is
remembered with the table it was decoded against and what it decoded to: the same bytes against
the same table and limits get the same list back without decoding. Pure: hpack's public API only.

The table is known unchanged from three things: its newest entry, compared by identity (every
field added is a new tuple at the front, and the one remembered here is held, so no other object can
take its place: equal fields added anew are another table), its length (only a resize removes
without adding, and it shortens the table) and its size limit (a field added that is larger than
the limit empties the table and leaves it as it was, empty: the same block under a larger limit
adds it). A block that changed the table is remembered with the table before it, which never comes
back. The limits a block is checked against (our SETTINGS) are part of what must match. Nothing
over `MAX_KEPT` bytes is remembered: a connection holds at most that much for it.
"""

from __future__ import annotations

from collections.abc import Iterable

from hpack import Decoder, HeaderTuple

MAX_KEPT = 1024  # bytes of a block kept: Envoy's are 57 (125 the first, which adds to the table)
MAX_HEADER_LIST = 1 << 16  # hpack's own default limit on a decoded header list


class RepeatDecoder(Decoder):
    """hpack's Decoder, remembering its last block, the table before it and what it decoded to."""

    def __init__(self, max_header_list_size: int = MAX_HEADER_LIST) -> None:
        super().__init__(max_header_list_size=max_header_list_size)
        self._block: bytes | None = None
        self._fields: list[HeaderTuple] = []
        self._newest: object = None  # the table's newest entry, held: no other object can take its id
        self._rest: tuple[object, ...] = ()
        self.repeats = 0  # blocks answered from memory (the tests count)

    def _table(self, raw: bool) -> tuple[object, tuple[object, ...]]:
        """What decoding a block depends on besides its bytes: the newest entry (compared by
        identity) and the rest."""
        table = self.header_table
        entries = table.dynamic_entries
        newest = entries[0] if entries else None
        return newest, (len(entries), table.maxsize, self.max_allowed_table_size, self.max_header_list_size, raw)

    def decode(self, data: bytes, raw: bool = False) -> Iterable[HeaderTuple]:
        newest, rest = self._table(raw)
        if data == self._block and newest is self._newest and rest == self._rest:
            self.repeats += 1
            return list(self._fields)
        fields = list(super().decode(data, raw))  # `newest` held meanwhile: its id stays its own
        if len(data) <= MAX_KEPT:
            self._block, self._fields, self._newest, self._rest = bytes(data), fields, newest, rest
        return list(fields)
