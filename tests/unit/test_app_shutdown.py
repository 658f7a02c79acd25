"""Shutdown is bounded: SIGTERM with thousands of open streams ends each one cleanly (grpc-status 0,
so Envoy keeps its endpoints and reconnects) and the process exits within --shutdown-timeout,
however many streams there are; streams not ended by then are cut, and the log says how many."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import pytest

from eds_server.options.parsing import duration
from tests.support.h2_client import Client, data, first_request, grpc
from tests.support.server_process import EdsServerProcess

CONNECTIONS, PER_CONNECTION = 4, 1000  # 4,000 streams
BATCH = 250  # streams opened per write


async def open_streams(port: int) -> list[tuple[Client, list[int]]]:
    """CONNECTIONS x PER_CONNECTION streams subscribed to "web", each with its first response read."""
    return [await _connection(port, c) for c in range(CONNECTIONS)]


async def _connection(port: int, c: int) -> tuple[Client, list[int]]:
    client = await Client.open(port)
    sids: list[int] = []
    for start in range(0, PER_CONNECTION, BATCH):
        chunk = b""
        for i in range(start, start + BATCH):
            sid, opening = client.new_stream()
            chunk += opening + data(sid, grpc(first_request(f"envoy-{c}-{i}", "web")))
            sids.append(sid)
        await client.send(chunk)
        await client.until(lambda: all(client.messages[s] for s in sids), wait=30)
    return client, sids


@pytest.mark.parametrize("timeout", ["5s", "300ms"])  # all end cleanly; most are cut
async def test_shutdown_with_thousands_of_streams_is_bounded(tmp_path: Path, timeout: str) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:1]\n")
    server = EdsServerProcess(path, "--shutdown-timeout", timeout, "--log-level", "info", workdir=tmp_path)
    await server.start()
    clients: list[tuple[Client, list[int]]] = []
    try:
        clients = await open_streams(server.port)
        assert sum(len(c.messages) for c, _ in clients) == CONNECTIONS * PER_CONNECTION
        total = (await server.admin("/v1/streams?limit=1"))["total"]
        assert total == CONNECTIONS * PER_CONNECTION
        assert server.proc is not None
        loop = asyncio.get_running_loop()
        began = loop.time()
        server.proc.send_signal(signal.SIGTERM)
        # the clients read their trailers meanwhile (a client that reads nothing is the cut case)
        readers = [
            asyncio.create_task(c.until(lambda c=c, s=s: all(x in c.trailers for x in s) or c.eof, wait=30))
            for c, s in clients
        ]
        bound = duration(timeout) + 10.0  # the stated bound, and the interpreter's own exit (freeing the heap)
        code = await asyncio.wait_for(server.proc.wait(), bound)
        took = loop.time() - began
        await asyncio.gather(*readers)
    finally:
        for c, _ in clients:
            c.close()
        if server.proc is not None and server.proc.returncode is None:
            server.proc.kill()
            await server.proc.wait()
    ended_ok = sum(1 for c, sids in clients for s in sids if c.status(s) == 0)
    log = server.log_text()
    print(f"shutdown of {CONNECTIONS * PER_CONNECTION} streams: {took:.2f}s, {ended_ok} ended with status 0")
    assert code == 0, log
    found = re.search(r"shutdown: (\d+) streams ended cleanly, (\d+) cut", log)
    assert found, log
    assert int(found[1]) + int(found[2]) == CONNECTIONS * PER_CONNECTION
    assert int(found[1]) == ended_ok
