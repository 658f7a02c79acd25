"""What an idle stream holds, counted: the objects the cyclic collector walks. Each one is
walked at the young and middle collections after it is made (a stream's share of connecting a
fleet) and at every full one while it lives, and is memory of its own. The fast path's streams,
over a real loopback socket with a raw HTTP/2 client, each answered its first response; nothing
measures time.
"""

from __future__ import annotations

import asyncio
import collections
import gc
from collections.abc import Iterable

import pytest

from eds_server.transport.h2 import ConnectionLimits
from tests.support.grpc_harness import serving
from tests.support.h2_client import client_of, data, first_request, grpc

pytestmark = pytest.mark.fast_path

STREAMS = 80  # on one connection (its limit is 100), after 10 that warm it up
# Measured 42.1 a stream with grpclib 0.4.9 and h2 4.x on CPython 3.11 (the versions compat.py
# verified): grpclib's stream and server Stream (with its events, buffer and queue), h2's stream
# state, the call's task and coroutines, the session and its machine. One object more a stream
# fails: a closure, a partial or a coroutine put back.
MOST = 43


def _reachable(roots: Iterable[object], within: dict[int, object]) -> set[int]:
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        for r in gc.get_referents(todo.pop()):
            if id(r) in within and id(r) not in seen:
                seen.add(id(r))
                todo.append(r)
    return seen


async def test_an_idle_stream_holds_few_objects_for_the_collector_to_walk() -> None:
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        for i in range(10):
            sid = await client.request(first_request(f"warm{i}", "web"))
            await client.response(sid, 1)
        await asyncio.sleep(0.2)  # the loop's own leftovers go (a bound wait, not a claim)
        gc.collect()
        before = {id(o) for o in gc.get_objects()}
        sids = []
        for i in range(STREAMS):
            sid, opening = client.new_stream()
            sids.append(sid)
            await client.send(opening + data(sid, grpc(first_request(f"n{i}", "web"))))
        for sid in sids:
            await client.response(sid, 1)
        await asyncio.sleep(0.2)
        gc.collect()
        new = {id(o): o for o in gc.get_objects() if id(o) not in before}
        new.pop(id(before), None)
        clients = _reachable([client], new)  # the test client's own
        held = [o for i, o in new.items() if i not in clients]
        assert len(service.sessions) == 10 + STREAMS
        kinds = collections.Counter(type(o).__qualname__ for o in held)
        assert kinds["StreamSession"] == STREAMS  # a floor: every stream counted is here
        per_stream = len(held) / STREAMS
        assert per_stream <= MOST, f"{per_stream:.1f} objects a stream: {kinds.most_common(12)}"
