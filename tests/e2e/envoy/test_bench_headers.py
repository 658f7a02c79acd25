"""The bench's load generator opens its streams with the header blocks a real Envoy sends.

What a server spends on each new stream depends on how its HEADERS are encoded: a literal costs more
to decode than an index into HPACK's dynamic table, and Huffman more than plain. The load generator
sends fixed blocks; this records what Envoy's gRPC client sends on one connection to an EDS server
and checks the blocks still match it, field by field and representation by representation.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hpack import Decoder

from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.paths import bench_module
from tests.support.ports import free_port

loadgen = bench_module("loadgen")

pytestmark = pytest.mark.envoy

HEADERS, SETTINGS = 1, 4


def representations(block: bytes) -> list[str]:
    """How each field of an HPACK block is encoded (RFC 7541 section 6), not what it says."""
    kinds: list[str] = []
    at = 0

    def integer(prefix: int) -> int:
        nonlocal at
        mask = (1 << prefix) - 1
        value = block[at] & mask
        at += 1
        if value < mask:
            return value
        shift = 0
        while True:
            byte = block[at]
            at += 1
            value += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    def string() -> str:
        nonlocal at
        huffman = bool(block[at] & 0x80)
        at += integer(7)
        return "huffman" if huffman else "plain"

    while at < len(block):
        first = block[at]
        if first & 0x80:
            kinds.append(f"indexed {integer(7)}")
            continue
        if first & 0xE0 == 0x20:
            kinds.append(f"size update {integer(5)}")
            continue
        kind, prefix = (
            ("incremental", 6) if first & 0x40 else ("never indexed", 4) if first & 0x10 else ("not indexed", 4)
        )
        name = integer(prefix)
        name_text = f"name {name}" if name else f"new name {string()}"
        kinds.append(f"{kind}, {name_text}, value {string()}")
    return kinds


async def test_the_load_generator_sends_what_envoy_sends() -> None:
    blocks: list[bytes] = []
    arrived = asyncio.Event()

    async def capture(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # our empty SETTINGS
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readexactly(len(loadgen.PREFACE))
            while True:
                head = await reader.readexactly(9)
                length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
                payload = await reader.readexactly(length)
                if kind == SETTINGS and not flags & 1:
                    writer.write(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00")
                elif kind == HEADERS:
                    assert flags & 0x4 and not flags & 0x28, "a block in one frame, no padding or priority"
                    blocks.append(payload)
                    if len(blocks) == 3:
                        arrived.set()

    port = free_port()
    server = await asyncio.start_server(capture, "127.0.0.1", port)
    try:
        bootstrap = envoy_bootstrap(port, [EdsCluster(f"c{n}") for n in range(3)])
        async with EnvoyProcess(bootstrap):
            await asyncio.wait_for(arrived.wait(), 20)
    finally:
        server.close()

    first, second, third = blocks[:3]
    assert second == third, "every stream after the first sends the same block"
    ours, envoys = Decoder(), Decoder()
    assert ours.decode(loadgen.FIRST_HEADERS) == envoys.decode(first)
    assert ours.decode(loadgen.LATER_HEADERS) == envoys.decode(second)
    assert representations(loadgen.FIRST_HEADERS) == representations(first)
    assert representations(loadgen.LATER_HEADERS) == representations(second)
    assert sum(k.startswith("indexed") for k in representations(second)) == 7  # all but :path
