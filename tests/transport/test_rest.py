"""REST-JSON EDS: status codes Envoy depends on, and JSON the official parser accepts."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from envoy.config.endpoint.v3 import endpoint_pb2  # registers the CLA type for Any in JSON
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format

from eds_server.encode import encode_group
from eds_server.model import Endpoint, Group
from eds_server.store import Store
from eds_server.transport.rest import PATH, make_rest_app
from eds_server.xds.common import EDS_TYPE_URL, SubscriptionLimits


@pytest.fixture
async def rest() -> AsyncIterator[tuple[Store, str]]:
    store = Store(encode_group)
    store.add_source("t")
    runner = web.AppRunner(make_rest_app(store, SubscriptionLimits(max_names=10), 64 * 1024))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield store, f"http://127.0.0.1:{port}{PATH}"
    finally:
        await runner.cleanup()


async def post(url: str, body: object) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(url, data=json.dumps(body)) as r:
        return r.status, await r.text()


REQ = {"node": {"id": "n", "cluster": "c"}, "resourceNames": ["web", "nope"], "typeUrl": EDS_TYPE_URL}


async def test_not_ready_is_503_then_200_then_304(rest: tuple[Store, str]) -> None:
    store, url = rest
    assert (await post(url, REQ))[0] == 503
    store.update("t", {"web": Group("web", (Endpoint("10.0.0.1", 80, weight=2),))})
    status, text = await post(url, REQ)
    assert status == 200
    official = json_format.Parse(text, discovery_pb2.DiscoveryResponse())
    assert official.type_url == EDS_TYPE_URL
    clas = [endpoint_pb2.ClusterLoadAssignment() for _ in official.resources]
    for any_, cla in zip(official.resources, clas, strict=True):
        any_.Unpack(cla)
    assert [c.cluster_name for c in clas] == ["web", "nope"]
    assert clas[0].endpoints[0].lb_endpoints[0].load_balancing_weight.value == 2
    assert not clas[1].endpoints  # unknown: empty, never 404
    assert (await post(url, {**REQ, "versionInfo": official.version_info}))[0] == 304


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        {**REQ, "typeUrl": "type.googleapis.com/envoy.config.cluster.v3.Cluster"},
        {**REQ, "resourceNames": "web"},
        {**REQ, "resourceNames": [f"n{i}" for i in range(11)]},
    ],
)
async def test_bad_requests_are_400(rest: tuple[Store, str], body: object) -> None:
    store, url = rest
    store.update("t", {})
    async with aiohttp.ClientSession() as s, s.post(url, data=body if isinstance(body, str) else json.dumps(body)) as r:
        assert r.status == 400


async def test_oversize_body_is_refused(rest: tuple[Store, str]) -> None:
    store, url = rest
    store.update("t", {})
    status, _ = await post(url, {**REQ, "node": {"id": "x" * 100_000}})
    assert status == 413


async def test_deeply_nested_json_is_a_400_not_a_500(rest: tuple[Store, str]) -> None:
    """json.loads raises RecursionError on deep nesting: a 400 naming it, and the server keeps serving."""
    store, url = rest
    store.update("t", {})
    async with aiohttp.ClientSession() as s, s.post(url, data="[" * 30_000 + "]" * 30_000) as r:
        assert r.status == 400 and "nested" in await r.text()
    assert (await post(url, {"resourceNames": ["web"]}))[0] == 200  # still serving


async def test_a_get_is_told_what_the_rest_port_serves(rest: tuple[Store, str]) -> None:
    """A curl or browser on the REST port gets JSON naming the one thing it answers, not plain `405`."""
    _, url = rest
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"
            assert f"POST {PATH}" in (await r.json())["message"]
        async with s.get(url.removesuffix(PATH) + "/") as r:
            assert r.status == 404 and f"POST {PATH}" in (await r.json())["message"]
