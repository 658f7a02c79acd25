"""Protobuf wire-format primitives: a message is the concatenation of its encoded fields.

Used to assemble messages from cached pieces (responses around cached resources, assignments
around cached endpoints) and to read a few fields without parsing a whole message.
"""

from __future__ import annotations


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position); ValueError on a truncated or overlong varint."""
    result = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise ValueError("bad varint")


def string_fields(message: bytes, wanted: set[int]) -> dict[int, str]:
    """The top-level string fields `wanted` of an encoded message, skipping everything else.

    Reading a Node's id and cluster this way costs a scan of its field headers, not a parse of
    its (often tens of kilobytes of) extensions and metadata.
    """
    found: dict[int, str] = {}
    pos = 0
    while pos < len(message):
        key, pos = read_varint(message, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = read_varint(message, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            size, pos = read_varint(message, pos)
            if number in wanted:
                found[number] = message[pos : pos + size].decode("utf-8", errors="replace")
            pos += size
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        if pos > len(message):
            raise ValueError("truncated message")
    return found


def length_delimited(field_number: int, data: bytes) -> bytes:
    return varint(field_number << 3 | 2) + varint(len(data)) + data


def string_field(field_number: int, value: str) -> bytes:
    return length_delimited(field_number, value.encode()) if value else b""
