"""xDS edge cases that other clients than a stock Envoy reach, each through the gRPC port.

The same cases are pinned on the state machines in unit/xds/test_sotw.py and unit/xds/test_delta.py; these show that
the transport, the store and /v1/streams agree with them. Decisions: docs/xds-behaviour.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import h2.exceptions
import pytest
from aiohttp import web
from grpclib import GRPCError
from grpclib.const import Cardinality, Status
from prometheus_client import CollectorRegistry

from eds_server import admin
from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.pb.envoy.service.discovery.v3 import (
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
    DiscoveryRequest,
    DiscoveryResponse,
)
from eds_server.pb.google.rpc import Status as RpcStatus
from eds_server.transport.grpc import StreamSession
from eds_server.xds.common import EDS_TYPE_URL, SubscriptionLimits
from tests.support.grpc_harness import SOURCE, Harness, cla_of, first, group, no_message, recv, reply
from tests.support.waiting import wait_for

DELTA = "/envoy.service.endpoint.v3.EndpointDiscoveryService/DeltaEndpoints"


@contextlib.asynccontextmanager
async def delta_stream(h: Harness) -> AsyncIterator[Any]:
    request = h.channel.request(DELTA, Cardinality.STREAM_STREAM, DeltaDiscoveryRequest, DeltaDiscoveryResponse)
    async with request as stream:
        try:
            yield stream
        finally:
            with contextlib.suppress(h2.exceptions.StreamClosedError):
                await stream.cancel()


def delta_first(*names: str, initial: dict[str, str] | None = None) -> DeltaDiscoveryRequest:
    return DeltaDiscoveryRequest(
        node=Node(id="delta-node"),
        type_url=EDS_TYPE_URL,
        resource_names_subscribe=list(names),
        initial_resource_versions=initial or {},
    )


def delta_reply(
    resp: DeltaDiscoveryResponse,
    error: str | None = None,
    subscribe: tuple[str, ...] = (),
    unsubscribe: tuple[str, ...] = (),
) -> DeltaDiscoveryRequest:
    return DeltaDiscoveryRequest(
        response_nonce=resp.nonce,
        resource_names_subscribe=list(subscribe),
        resource_names_unsubscribe=list(unsubscribe),
        error_detail=RpcStatus(code=3, message=error) if error else None,
    )


def delta_names(resp: DeltaDiscoveryResponse) -> list[str]:
    return [r.name for r in resp.resources]


async def ended_with(stream: Any) -> tuple[Status, str]:
    """The status that ends the call, read as any grpclib client reads it: from the first read after
    the last message, or from the trailers once the messages end."""
    try:
        while await asyncio.wait_for(stream.recv_message(), 5) is not None:
            pass
        await stream.end()
        await asyncio.wait_for(stream.recv_trailing_metadata(), 5)
    except GRPCError as e:
        return e.status, e.message or ""
    return Status.OK, ""


async def read_all_sent(h: Harness) -> None:
    """Until the client has taken in all the server sent on its streams: they are gone on the
    server's side, then a fetch is answered on the same connection (its frames come in order)."""
    await wait_for(lambda: h.service.open_streams == 0, timeout=5, what="the server's side of the streams ended")
    fetch = "/envoy.service.endpoint.v3.EndpointDiscoveryService/FetchEndpoints"
    async with h.channel.request(fetch, Cardinality.UNARY_UNARY, DiscoveryRequest, DiscoveryResponse) as call:
        await call.send_message(first("web"), end=True)
        await recv(call)


def session(h: Harness) -> StreamSession:
    [only] = h.service.sessions
    return only


def store_agrees(h: Harness) -> bool:
    """Every stream's subscriptions are exactly what the store tells it about."""
    following = h.store.subscriptions()
    return all(set(s.sm.subscribed) == following.get(s.on_change, set()) for s in h.service.sessions)


# -- 1 --------------------------------------------------------------------------------------------


async def test_delta_streams_show_the_version_envoy_holds_as_acked(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    good = harness.store.get("web").version
    async with delta_stream(harness) as stream:
        await stream.send_message(delta_first("web"))
        r1 = await recv(stream)
        await stream.send_message(delta_reply(r1))
        await wait_for(lambda: session(harness).describe()["names"]["web"]["acked"] == good, timeout=5.0)
        harness.store.update(SOURCE, {"web": group("web", 2)})
        r2 = await recv(stream)
        bad = r2.resources[0].version
        assert session(harness).describe()["names"]["web"]["acked"] == good  # in flight: still the old one
        await stream.send_message(delta_reply(r2, error="rejected"))
        await wait_for(lambda: harness.service.counters.nacks == 1, timeout=5.0)
        assert session(harness).describe()["names"]["web"] == {"sent": bad, "acked": good, "nacked": bad}


# -- 2 --------------------------------------------------------------------------------------------


async def test_delta_subscribe_and_unsubscribe_in_one_request_leave_state_and_store_agreeing(
    harness: Harness,
) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1), "api": group("api", 1)})
    async with delta_stream(harness) as stream:
        await stream.send_message(delta_first("web", "api"))
        r1 = await recv(stream)
        # both lists name "web" (subscribed) and "new" (not): subscribes first, then unsubscribes
        await stream.send_message(delta_reply(r1, subscribe=("web", "new"), unsubscribe=("web", "new")))
        await wait_for(lambda: list(session(harness).sm.subscribed) == ["api"], timeout=5.0)
        assert store_agrees(harness)
        await no_message(stream)
        harness.store.update(SOURCE, {"web": group("web", 2), "api": group("api", 2)})
        r2 = await recv(stream)
        assert delta_names(r2) == ["api"]


# -- 3 --------------------------------------------------------------------------------------------


async def test_sotw_unsubscribing_while_in_flight_then_acking_keeps_nothing(harness: Harness) -> None:
    harness.store.update(SOURCE, {})
    async with harness.stream() as stream:
        await stream.send_message(first("seed"))
        resp = await recv(stream)
        for i in range(10):  # bounded: rounds of 300 long names
            names = [f"{i}-{j}-" + "x" * 200 for j in range(300)]
            await stream.send_message(reply(resp, *names))
            resp = await recv(stream)
            # "drop everything", written before the response was read: no nonce, so stale
            await stream.send_message(DiscoveryRequest(type_url=EDS_TYPE_URL))
            await no_message(stream, 0.05)
        await stream.send_message(reply(resp))  # ACKs the last one, and drops everything
        await wait_for(lambda: not session(harness).sm.subscribed, timeout=5.0)
        sm = session(harness).sm
        assert not sm.acked and not sm.sent and not sm.nacked
        assert store_agrees(harness) and not list(harness.store.followed())


async def test_sotw_empty_nonce_after_a_response_is_stale(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with harness.stream() as stream:
        await stream.send_message(first("web"))
        r1 = await recv(stream)
        await stream.send_message(DiscoveryRequest(resource_names=["web", "api"], type_url=EDS_TYPE_URL))
        await no_message(stream)
        assert list(session(harness).sm.subscribed) == ["web"]
        await stream.send_message(reply(r1, "web", "api"))
        r2 = await recv(stream)
        assert [cla_of(r2, i).cluster_name for i in range(len(r2.resources))] == ["api"]


async def test_sotw_a_name_dropped_by_a_stale_request_is_sent_again_when_listed_again(harness: Harness) -> None:
    """The client dropped `web` before it read r1, so it ignored `web` in r1; asked for again, it gets it."""
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with harness.stream() as stream:
        await stream.send_message(first("web"))
        r1 = await recv(stream)
        await stream.send_message(DiscoveryRequest(type_url=EDS_TYPE_URL))  # drops everything: stale
        await no_message(stream)
        assert list(session(harness).sm.subscribed) == ["web"]
        await stream.send_message(reply(r1, "web"))  # ACKs r1, asks for `web` again
        r2 = await recv(stream)
        assert [cla_of(r2, i).cluster_name for i in range(len(r2.resources))] == ["web"]
        assert r2.version_info == r1.version_info  # unchanged, but new to the client
        await stream.send_message(reply(r2, "web"))
        await wait_for(lambda: session(harness).sm.acked == {"web": r2.version_info}, timeout=5.0)
        assert store_agrees(harness)


# -- 4 --------------------------------------------------------------------------------------------


async def test_delta_max_names_is_a_total_per_stream(harness: Harness) -> None:
    harness.store.update(SOURCE, {})
    harness.service.limits = SubscriptionLimits(max_names=100)
    async with delta_stream(harness) as stream:
        await stream.send_message(delta_first(*(f"a{i}" for i in range(60))))
        r1 = await recv(stream)
        await stream.send_message(delta_reply(r1, subscribe=tuple(f"b{i}" for i in range(60))))
        status, message = await ended_with(stream)
        assert status == Status.RESOURCE_EXHAUSTED and "120 resource names subscribed on one stream" in message


async def test_delta_reconnect_with_its_versions_counts_each_name_once(harness: Harness) -> None:
    harness.store.update(SOURCE, {"a0": group("a0", 1)})
    harness.service.limits = SubscriptionLimits(max_names=100)
    names = [f"a{i}" for i in range(60)]
    held = {n: harness.store.get(n).version for n in names}
    held["a0"] = "old"
    async with delta_stream(harness) as stream:
        await stream.send_message(delta_first(*names, initial=held))  # 60 names + 60 versions
        r1 = await recv(stream)
        assert delta_names(r1) == ["a0"]  # only what it lacked


async def test_streams_page_is_bounded(harness: Harness) -> None:
    harness.store.update(SOURCE, {})
    async with contextlib.AsyncExitStack() as stack:
        streams = [await stack.enter_async_context(harness.stream()) for _ in range(5)]
        for i, s in enumerate(streams):
            await s.send_message(first(*(f"n{i}-{j}" for j in range(150))))
            await recv(s)
        app = admin.make_app(harness.store, list, dict, harness.service.describe_streams, CollectorRegistry())
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/streams"
        try:
            seen: list[dict[str, Any]] = []
            after: int | None = 0
            async with aiohttp.ClientSession() as http:
                for _ in range(10):  # bounded
                    async with http.get(base, params={"after": str(after), "limit": "2"}) as r:
                        page = await r.json()
                    assert len(page["streams"]) <= 2 and page["total"] == 5
                    seen += page["streams"]
                    after = page["next_after"]
                    if after is None:
                        break
                async with http.get(base, params={"limit": "x"}) as r:
                    assert r.status == 400
            assert len(seen) == 5 and len({s["id"] for s in seen}) == 5
            assert all(len(s["names"]) == 100 and s["names_total"] == 150 for s in seen)
        finally:
            await runner.cleanup()


# -- 5 --------------------------------------------------------------------------------------------


async def test_sotw_reconnect_gets_a_name_it_had_dropped(harness: Harness) -> None:
    harness.store.update(SOURCE, {"a": group("a", 1), "b": group("b", 2)})
    async with harness.stream() as stream:
        await stream.send_message(first("a", "b"))
        r1 = await recv(stream)
        await stream.send_message(reply(r1, "a"))  # drops b; its version_info stays r1's
        await no_message(stream)
    async with harness.stream() as stream:  # reconnects asking for both again
        await stream.send_message(first("a", "b", version=r1.version_info))
        r2 = await recv(stream)
        assert sorted(cla_of(r2, i).cluster_name for i in range(len(r2.resources))) == ["a", "b"]


# -- 6 --------------------------------------------------------------------------------------------


async def test_delta_resubscribing_a_rejected_name_sends_it(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with delta_stream(harness) as stream:
        await stream.send_message(delta_first("web"))
        r1 = await recv(stream)
        await stream.send_message(delta_reply(r1, error="rejected"))
        await no_message(stream)
        await stream.send_message(DeltaDiscoveryRequest(resource_names_subscribe=["web"]))
        r2 = await recv(stream)
        assert delta_names(r2) == ["web"]


# -- 7 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("names", [("*",), ()])
async def test_sotw_wildcard_or_nothing_gets_an_empty_answer(harness: Harness, names: tuple[str, ...]) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with harness.stream() as stream:
        await stream.send_message(first(*names))
        r1 = await recv(stream)
        assert not r1.resources  # no CLA named "*", and not left waiting
        await stream.send_message(reply(r1, "*", "web"))
        r2 = await recv(stream)
        assert [cla_of(r2, i).cluster_name for i in range(len(r2.resources))] == ["web"]


async def test_delta_and_fetch_never_serve_a_resource_named_star(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with delta_stream(harness) as stream:
        await stream.send_message(delta_first("*"))
        r1 = await recv(stream)
        assert not r1.resources
        await stream.send_message(delta_reply(r1, subscribe=("*", "web")))
        assert delta_names(await recv(stream)) == ["web"]
    fetch = "/envoy.service.endpoint.v3.EndpointDiscoveryService/FetchEndpoints"
    async with harness.channel.request(fetch, Cardinality.UNARY_UNARY, DiscoveryRequest, DiscoveryResponse) as call:
        await call.send_message(first("*", "web"), end=True)
        resp = await recv(call)
    assert [cla_of(resp, i).cluster_name for i in range(len(resp.resources))] == ["web"]


# -- 8 --------------------------------------------------------------------------------------------


async def test_a_present_but_empty_node_is_accepted(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with harness.stream() as stream:
        await stream.send_message(DiscoveryRequest(node=Node(), resource_names=["web"], type_url=EDS_TYPE_URL))
        assert cla_of(await recv(stream)).cluster_name == "web"
    async with delta_stream(harness) as stream:
        await stream.send_message(DeltaDiscoveryRequest(node=Node(), resource_names_subscribe=["web"]))
        assert delta_names(await recv(stream)) == ["web"]


# -- 9 --------------------------------------------------------------------------------------------


async def test_sotw_the_good_half_of_a_rejected_bundle_is_resent(harness: Harness) -> None:
    harness.store.update(SOURCE, {"good": group("good", 1), "bad": group("bad", 2)})
    async with harness.stream() as stream:
        await stream.send_message(first("good", "bad"))
        r1 = await recv(stream)
        await stream.send_message(reply(r1, "good", "bad", error="bad is bad"))
        seen = []
        for _ in range(3):  # bounded: each resent alone, once
            r = await recv(stream)
            [cla] = [cla_of(r)]
            assert len(r.resources) == 1
            seen.append(cla.cluster_name)
            error = "bad is bad" if cla.cluster_name == "bad" else None
            await stream.send_message(reply(r, "good", "bad", error=error))
            if len(seen) == 2:
                break
        assert seen == ["good", "bad"]
        await no_message(stream)  # and nothing more: the bad one is not resent
        names = session(harness).describe()["names"]
        assert names["good"]["acked"] == harness.store.get("good").version and names["good"]["nacked"] is None
        assert names["bad"]["acked"] is None and names["bad"]["nacked"] == harness.store.get("bad").version


# -- 11 -------------------------------------------------------------------------------------------


async def test_grpclib_clients_read_the_status_not_a_reset(harness: Harness) -> None:
    """The error trailers end the call: no RST_STREAM after them, so the status is what the client reads."""
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with harness.stream() as stream:
        await stream.send_message(DiscoveryRequest(resource_names=["web"]))  # no node
        await read_all_sent(harness)  # trailers (and, before, the reset) arrive before the client reads
        with pytest.raises(GRPCError) as e:
            await stream.recv_message()  # was StreamTerminatedError("Stream reset by remote party")
        assert e.value.status == Status.INVALID_ARGUMENT
    harness.service.limits = SubscriptionLimits(max_names=1)
    async with harness.stream() as stream:
        await stream.send_message(first("web"))
        r1 = await recv(stream)
        await stream.send_message(reply(r1, "web", "api"))  # over the limit, after a response
        await read_all_sent(harness)
        assert (await ended_with(stream))[0] == Status.RESOURCE_EXHAUSTED
    async with harness.stream() as stream:  # far over it: refused before the rest is parsed
        await stream.send_message(first(*["a"] * 100_000))
        await read_all_sent(harness)
        status, message = await ended_with(stream)
        assert status == Status.RESOURCE_EXHAUSTED and "more than 1 resource names" in (message or "")
    await wait_for(lambda: harness.service.open_streams == 0, timeout=2.0)  # the server side is gone too
