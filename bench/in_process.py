"""eds-server's fast path started in this process, for the benches that run it beside the load
generator (bench/loadgen.py) in one process: bench/connect_cycle.py and bench/private_touches.py;
and their instruction counts under callgrind.

One source, "bench", holding one group; every per-client limit out of the way (these measure work,
not refusals); the usual stream settings.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import AsyncIterator

from eds_server.encode import encode_group
from eds_server.model import Group
from eds_server.store import Store
from eds_server.transport import grpc
from eds_server.transport.h2.limits import ConnectionLimits

UNBOUNDED = ConnectionLimits(stream_budget=10**9, pending_streams=10**9, reset_budget=10**9, control_budget=10**9)


@contextlib.asynccontextmanager
async def serving(group: Group, max_streams: int) -> AsyncIterator[tuple[Store, int]]:
    """The store (its source "bench" holding `group`) and the port of a fast-path server on it."""
    store = Store(encode_group)
    store.add_source("bench")
    store.update("bench", {group.name: group})
    service = grpc.EdsService(store, send_timeout=5)
    server = grpc.make_server(
        service,
        max_streams_per_connection=max_streams,
        keepalive_time=30,
        keepalive_timeout=10,
        max_message_size=1 << 20,
        limits=UNBOUNDED,
        http2="fast",
    )
    await server.start("127.0.0.1", 0)
    try:
        yield store, server.port
    finally:
        service.stop()
        server.close()
        await server.wait_closed()


def instructions(script: str, *args: str) -> int:
    """Instructions of one run of `script` with `args` under valgrind's callgrind (the
    interpreter's start included: take differences of two runs)."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, script, *args],
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Collected : (\d+)", out.stderr)
    assert found, out.stderr[-2000:]
    return int(found.group(1))
