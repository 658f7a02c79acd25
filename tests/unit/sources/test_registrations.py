"""The registration API over real HTTP (aiohttp on 127.0.0.1), a real Store and a real state file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from eds_server.encode import encode_group
from eds_server.health.spec import HealthSpec
from eds_server.model import Endpoint, Group
from eds_server.registration_api import add_routes
from eds_server.sources.registrations import RegistrationSource, RegistrationStateError
from eds_server.store import Store
from tests.support.feeds import alone
from tests.support.waiting import wait_for

TOKEN = "s3cret-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
Headers = dict[str, str] | None


@dataclass
class Answer:
    status: int
    body: Any
    headers: Any


class Server:
    def __init__(self, store: Store, source: RegistrationSource, base: str, session: aiohttp.ClientSession) -> None:
        self.store = store
        self.source = source
        self.base = base
        self.session = session

    async def request(
        self, method: str, path: str, body: Any = None, *, data: bytes | None = None, headers: Headers = None
    ) -> Answer:
        if data is None and body is not None:
            data = json.dumps(body).encode()
        url = self.base + path
        async with self.session.request(method, url, data=data, headers=AUTH if headers is None else headers) as r:
            text = await r.text()
            return Answer(r.status, json.loads(text) if text else None, r.headers)

    async def put(self, group: str, id: str, body: Any, **kw: Any) -> Answer:
        return await self.request("PUT", f"/v1/groups/{group}/endpoints/{id}", body, **kw)

    async def delete(self, group: str, id: str, **kw: Any) -> Answer:
        return await self.request("DELETE", f"/v1/groups/{group}/endpoints/{id}", **kw)

    def versions(self) -> dict[str, str]:
        return {name: r.version for name, r in self.store.resources().items()}

    def ports(self, group: str) -> list[int]:
        return sorted(e.port for e in self.store.get(group).group.endpoints)

    def snapshot(self) -> tuple[dict[str, str], bytes | None, list[Any]]:
        """Everything a refused request must leave alone: store versions, state file, registrations."""
        path = self.source.state_path
        data = Path(path).read_bytes() if path is not None and os.path.exists(path) else None
        return self.versions(), data, sorted((r.group, r.id, r.endpoint, r.ttl) for r in self.source.registrations())


@contextlib.asynccontextmanager
async def serving(
    state: Path | None,
    *,
    token: str | None = TOKEN,
    store: Store | None = None,
    api: dict[str, Any] | None = None,
    **source_options: Any,
) -> AsyncIterator[Server]:
    store = store if store is not None else Store(encode_group)
    source = alone(RegistrationSource, store, None if state is None else str(state), **source_options)
    source.load()
    stop = asyncio.Event()
    task = asyncio.create_task(source.run(stop))
    app = web.Application()
    add_routes(app, source, token, **(api or {}))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            yield Server(store, source, f"http://127.0.0.1:{port}", session)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await runner.cleanup()


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state" / "registrations.json"


@pytest.fixture
async def server(state: Path) -> AsyncIterator[Server]:
    state.parent.mkdir()
    async with serving(state) as s:
        yield s


def ep(port: Any, **more: Any) -> dict[str, Any]:
    return {"address": "10.0.0.1", "port": port, **more}


# -- the happy path ---------------------------------------------------------------------------------
async def test_register_replace_read_delete(server: Server, state: Path) -> None:
    a = await server.put("web", "web-1", ep(8080, weight=3, region="eu", hostname="h1", metadata={"v": "2"}))
    assert a.status == 201, a.body
    assert a.headers["Location"] == "/v1/groups/web/endpoints/web-1"
    assert a.body == {
        "group": "web",
        "id": "web-1",
        "address": "10.0.0.1",
        "port": 8080,
        "health": "unknown",
        "weight": 3,
        "region": "eu",
        "hostname": "h1",
        "metadata": {"v": "2"},
    }
    assert server.ports("web") == [8080]
    assert server.store.sources_of("web") == ["registrations"]
    saved = json.loads(state.read_text())
    assert saved["version"] == 1
    assert [(r["group"], r["id"], r["endpoint"]["port"]) for r in saved["registrations"]] == [("web", "web-1", 8080)]

    same = await server.put("web", "web-1", ep(8080, weight=3, region="eu", hostname="h1", metadata={"v": "2"}))
    assert same.status == 200 and same.body == a.body
    replaced = await server.put("web", "web-1", ep(8081, health="healthy"))
    assert replaced.status == 200
    assert replaced.body["port"] == 8081 and replaced.body["health"] == "healthy" and "weight" not in replaced.body
    assert server.ports("web") == [8081]

    await server.put("web", "web-2", ep(8082))
    await server.put("api", "a:1", {"address": "2001:db8::7", "port": 9000})
    one = await server.request("GET", "/v1/groups/web/endpoints/web-2", headers={})
    assert one.status == 200 and one.body["port"] == 8082
    group = await server.request("GET", "/v1/groups/web/endpoints", headers={})  # reads need no token
    assert group.status == 200
    assert [r["id"] for r in group.body["registrations"]] == ["web-1", "web-2"]
    listed = await server.request("GET", "/v1/registrations", headers={})
    assert listed.status == 200 and listed.body["count"] == 3
    assert [(r["group"], r["id"]) for r in listed.body["registrations"]] == [
        ("api", "a:1"),
        ("web", "web-1"),
        ("web", "web-2"),
    ]
    assert (await server.request("GET", "/v1/groups/none/endpoints", headers={})).body["registrations"] == []
    assert (await server.request("GET", "/v1/groups/web/endpoints/nope", headers={})).status == 404

    gone = await server.delete("web", "web-1")
    assert gone.status == 204 and gone.body is None
    assert server.ports("web") == [8082]
    assert (await server.delete("web", "web-1")).status == 404
    assert (await server.delete("api", "a:1")).status == 204
    assert "api" not in server.store.resources()  # its last endpoint left: the group is gone
    assert [r["id"] for r in json.loads(state.read_text())["registrations"]] == ["web-2"]


async def test_a_post_to_a_group_points_to_put_with_an_id(server: Server) -> None:
    before = server.snapshot()
    answer = await server.request("POST", "/v1/groups/web/endpoints", {"address": "10.0.0.1", "port": 80})
    assert answer.status == 405 and answer.headers["Allow"] == "GET,HEAD"
    assert "PUT /v1/groups/web/endpoints/{id}" in answer.body["hint"] and answer.body["error"]
    assert server.snapshot() == before


async def test_group_names_are_the_files_rule_and_may_hold_any_printable_character(server: Server) -> None:
    a = await server.put("outbound|80||a%2Fb", "x", ep(1))  # %2F: a '/' in the group name
    assert a.status == 201, a.body
    assert a.body["group"] == "outbound|80||a/b"
    assert server.ports("outbound|80||a/b") == [1]


# -- refusals, each changing nothing ----------------------------------------------------------------
BAD_BODIES: list[tuple[str, bytes, int, str | None]] = [
    ("not JSON", b"{address: 1", 400, None),
    ("empty", b"", 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("NaN", b'{"address": "10.0.0.1", "port": 1, "metadata": {"a": NaN}}', 400, None),
    ("not UTF-8", b'{"address": "\xff"}', 400, None),
    ("duplicate key", b'{"address": "10.0.0.1", "port": 1, "port": 2}', 422, "port"),
]
BAD_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    ("bad ip", {"address": "10.0.0.300", "port": 1}, "address"),
    ("hostname", {"address": "backend.local", "port": 1}, "address"),
    ("port 0", ep(0), "port"),
    ("port too big", ep(70000), "port"),
    ("port float", ep(80.5), "port"),
    ("missing port", {"address": "10.0.0.1"}, "port"),
    ("missing address", {"port": 1}, "address"),
    ("weight 0", ep(1, weight=0), "weight"),
    ("weight bool", ep(1, weight=True), "weight"),
    ("priority", ep(1, priority=129), "priority"),
    ("health", ep(1, health="sick"), "health"),
    ("region", ep(1, region=["eu"]), "region"),
    ("unknown field", ep(1, colour="blue"), "colour"),
    ("metadata not object", ep(1, metadata=[1]), "metadata"),
    ("metadata too deep", ep(1, metadata=json.loads('{"a":' * 30 + "1" + "}" * 30)), "metadata"),
    ("ttl 0", ep(1, ttl=0), "ttl"),
    ("ttl negative", ep(1, ttl=-1), "ttl"),
    ("ttl string", ep(1, ttl="30"), "ttl"),
    ("ttl over a day", ep(1, ttl=86_401), "ttl"),
    ("health check not an object", ep(1, health_check="/health"), "health_check"),
    ("health check kind", ep(1, health_check={"htpp": "/health"}), "health_check.htpp"),
    (
        "health check threshold",
        ep(1, health_check={"tcp": True, "unhealthy_threshold": 0}),
        "health_check.unhealthy_threshold",
    ),
]


@pytest.mark.parametrize(("data", "status", "field"), [b[1:] for b in BAD_BODIES], ids=[b[0] for b in BAD_BODIES])
async def test_bad_bodies(server: Server, data: bytes, status: int, field: str | None) -> None:
    await server.put("web", "kept", ep(1))
    before = server.snapshot()
    a = await server.put("web", "new", None, data=data)
    assert (a.status, a.body["field"]) == (status, field), a.body
    assert a.body["error"]
    assert server.snapshot() == before


@pytest.mark.parametrize(("body", "field"), [b[1:] for b in BAD_FIELDS], ids=[b[0] for b in BAD_FIELDS])
async def test_invalid_fields_are_422(server: Server, body: dict[str, Any], field: str) -> None:
    await server.put("web", "kept", ep(1))
    before = server.snapshot()
    for id in ("new", "kept"):  # neither a new registration nor a replacement
        a = await server.put("web", id, body)
        assert (a.status, a.body["field"]) == (422, field), a.body
    assert server.snapshot() == before


@pytest.mark.parametrize(
    ("group", "id", "field"),
    [
        ("web", "a b", "id"),
        ("web", "x" * 257, "id"),
        ("web", "a%2Fb", "id"),
        ("%20web", "x", "group"),
        ("w" * 1025, "x", "group"),
    ],
)
async def test_bad_path_parts_are_422(server: Server, group: str, id: str, field: str) -> None:
    before = server.snapshot()
    for method in ("PUT", "DELETE"):
        a = await server.request(method, f"/v1/groups/{group}/endpoints/{id}", ep(1))
        assert (a.status, a.body["field"]) == (422, field), a.body
    assert server.snapshot() == before
    assert (await server.put("w" * 1024, "x" * 256, ep(1))).status == 201  # the longest allowed


async def test_the_same_address_under_another_id_is_409(server: Server) -> None:
    await server.put("web", "one", ep(80))
    before = server.snapshot()
    a = await server.put("web", "two", ep(80, weight=2))
    assert (a.status, a.body["field"]) == (409, "address") and "'one'" in a.body["error"]
    assert server.snapshot() == before
    assert (await server.put("other", "two", ep(80))).status == 201  # another group: fine
    assert (await server.put("web", "one", ep(81))).status == 200  # moving "one" frees :80
    assert (await server.put("web", "two", ep(80))).status == 201


async def test_weights_of_a_locality_must_fit_in_uint32(server: Server) -> None:
    assert (await server.put("web", "a", ep(1, weight=2**32 - 2))).status == 201
    before = server.snapshot()
    a = await server.put("web", "b", ep(2, weight=2))
    assert (a.status, a.body["field"]) == (409, "weight")
    assert server.snapshot() == before
    assert (await server.put("web", "b", ep(2, weight=1))).status == 201  # exactly 2**32 - 1
    assert (await server.put("web", "b", ep(2, weight=1, zone="z"))).status == 200  # another locality


async def test_weights_merged_with_another_source_must_fit(state: Path) -> None:
    """Envoy sees the file's and the registrations' endpoints of a group together: a registration
    that would push the merged group past Envoy's limit is refused and changes nothing."""
    state.parent.mkdir()
    store = Store(encode_group)
    store.add_source("file")
    store.update("file", {"web": Group("web", (Endpoint("10.0.0.9", 80, weight=2**32 - 3),))})
    async with serving(state, store=store) as server:
        assert (await server.put("web", "a", ep(1, weight=2))).status == 201  # exactly the limit
        before = server.snapshot()
        a = await server.put("web", "b", ep(2, priority=0))
        assert (a.status, a.body["field"]) == (409, "weight")
        assert "merged with the other sources" in a.body["error"] and "4294967295" in a.body["error"]
        assert server.snapshot() == before and store.conflict("web") is None
        assert (await server.put("web", "b", ep(2, priority=1))).status == 201  # another priority fits
        assert (await server.put("api", "c", ep(3, weight=2**32 - 1))).status == 201  # another group


async def test_limit(state: Path) -> None:
    state.parent.mkdir()
    async with serving(state, max_registrations=2) as server:
        assert (await server.put("web", "a", ep(1))).status == 201
        assert (await server.put("api", "b", ep(2))).status == 201
        before = server.snapshot()
        a = await server.put("web", "c", ep(3))
        assert a.status == 409 and "limit reached (2)" in a.body["error"]
        assert server.snapshot() == before
        assert (await server.put("web", "a", ep(5, ttl=60))).status == 200  # replacing is not adding
        assert (await server.delete("api", "b")).status == 204
        assert (await server.put("web", "c", ep(3))).status == 201


async def test_state_size_limit(state: Path) -> None:
    state.parent.mkdir()
    async with serving(state, max_state_bytes=400) as server:
        assert (await server.put("web", "a", ep(1, metadata={"k": "v" * 100}))).status == 201
        before = server.snapshot()
        a = await server.put("web", "b", ep(2, metadata={"k": "v" * 300}))
        assert a.status == 409 and "limit reached" in a.body["error"]
        assert server.snapshot() == before


async def test_body_over_the_limit_is_413(server: Server) -> None:
    big = json.dumps(ep(1, metadata={"k": "x" * 70_000})).encode()
    before = server.snapshot()
    a = await server.put("web", "a", None, data=big)  # Content-Length says it all
    assert a.status == 413, a.body

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while read
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    async with server.session.put(f"{server.base}/v1/groups/web/endpoints/a", data=chunks(), headers=AUTH) as r:
        assert r.status == 413
        assert "Content-Length" not in r.request_info.headers
    assert server.snapshot() == before
    assert (await server.put("web", "a", ep(1, metadata={"k": "x" * 60_000}))).status == 201  # under 64 KiB


async def test_a_body_that_never_ends_is_408(state: Path) -> None:
    state.parent.mkdir()
    async with serving(state, api={"body_timeout": 0.3}) as server:
        host, port = server.base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"PUT /v1/groups/web/endpoints/a HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
            + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
            + b'{"address"'
        )
        status = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert status.split()[1] == b"408"
        assert server.source.registrations() == []


# -- the token --------------------------------------------------------------------------------------
async def test_writes_need_the_token(server: Server) -> None:
    await server.put("web", "kept", ep(1))
    before = server.snapshot()
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"Authorization": f"Bearer {TOKEN}x"},
    ):
        for answer in (
            await server.put("web", "new", ep(2), headers=headers),
            await server.put("web", "kept", ep(3), headers=headers),
            await server.delete("web", "kept", headers=headers),
        ):
            assert answer.status == 401, (headers, answer.body)
            assert answer.headers["WWW-Authenticate"].startswith("Bearer")
            assert answer.body["error"]
    assert server.snapshot() == before
    assert (await server.put("web", "new", ep(2), headers={"Authorization": f"bearer {TOKEN}"})).status == 201


@pytest.mark.parametrize("auth", [b"Bearer \xff\xfe", "Bearer t\u00f6k".encode("latin-1"), b"Bearer"])
async def test_odd_authorization_bytes_are_401(server: Server, auth: bytes) -> None:
    host, port = server.base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(ep(1)).encode()
    writer.write(
        b"PUT /v1/groups/web/endpoints/a HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: "
        + auth
        + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )
    status = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert status.split()[1] == b"401"
    assert server.source.registrations() == []


async def test_the_configured_token_is_stripped(state: Path) -> None:
    state.parent.mkdir()
    async with serving(state, token=f" {TOKEN}\n") as server:
        assert (await server.put("web", "a", ep(1))).status == 201


@pytest.mark.parametrize("token", [None, ""])
async def test_without_a_token_writes_are_off(state: Path, token: str | None) -> None:
    state.parent.mkdir()
    async with serving(state, token=token) as server:
        for answer in (
            await server.put("web", "a", ep(1)),
            await server.put("web", "a", ep(1), headers={"Authorization": "Bearer "}),
            await server.delete("web", "a"),
        ):
            assert answer.status == 403
            assert "--admin-token" in answer.body["error"] and "EDS_ADMIN_TOKEN" in answer.body["error"]
        assert server.source.registrations() == []
        assert (await server.request("GET", "/v1/registrations")).status == 200


# -- TTL --------------------------------------------------------------------------------------------
class FakeClock:
    """The source's two clocks, moved by the test: expiry is decided without waiting for it."""

    def __init__(self) -> None:
        self.wall_now, self.mono_now = 1_700_000_000.0, 1_000.0

    def wall(self) -> float:
        return self.wall_now

    def mono(self) -> float:
        return self.mono_now

    def advance(self, seconds: float) -> None:
        self.wall_now += seconds
        self.mono_now += seconds


async def test_ttl_expiry_and_renewal(state: Path) -> None:
    state.parent.mkdir()
    clock = FakeClock()
    async with serving(state, clock=clock.wall, monotonic=clock.mono) as server:
        a = await server.put("web", "short", ep(1, ttl=30))
        assert a.status == 201 and a.body["ttl"] == 30 and a.body["expires_in"] == 30
        await server.put("web", "renewed", ep(2, ttl=60))
        await server.put("web", "forever", ep(3))
        saved = {r["id"]: r for r in json.loads(state.read_text())["registrations"]}
        assert saved["short"]["ttl"] == 30 and saved["short"]["expires_at"] == clock.wall_now + 30
        assert "expires_at" not in saved["forever"]
        assert server.ports("web") == [1, 2, 3]

        clock.advance(40)  # "short" is past its TTL; "renewed" has 20 s left, and is renewed
        assert (await server.put("web", "renewed", ep(2, ttl=60))).status == 200  # a renewal: 200
        await wait_for(lambda: server.ports("web") == [2, 3])
        assert server.source.get("web", "short") is None
        clock.advance(30)  # 70 s after the first registration of "renewed": renewed, so still here
        assert server.source.expire() == 0 and server.ports("web") == [2, 3]
        clock.advance(31)  # 61 s after the renewal: gone, on the source's own time
        await wait_for(lambda: server.ports("web") == [3])
        listed = await server.request("GET", "/v1/registrations")
        assert [r["id"] for r in listed.body["registrations"]] == ["forever"]
        await wait_for(lambda: [r["id"] for r in json.loads(state.read_text())["registrations"]] == ["forever"])


async def test_a_put_without_ttl_makes_it_permanent(state: Path) -> None:
    state.parent.mkdir()
    clock = FakeClock()
    async with serving(state, clock=clock.wall, monotonic=clock.mono) as server:
        await server.put("web", "a", ep(1, ttl=30))
        assert (await server.put("web", "a", ep(1))).status == 200
        clock.advance(3600)
        assert server.source.expire() == 0 and server.ports("web") == [1]


async def test_expired_while_down_is_dropped_at_load(state: Path) -> None:
    state.parent.mkdir()
    async with serving(state) as server:
        await server.put("web", "short", ep(1, ttl=5))
        await server.put("web", "long", ep(2, ttl=500))
        await server.put("web", "forever", ep(3))
    later = alone(RegistrationSource, Store(encode_group), str(state), clock=lambda: time.time() + 100)
    later.load()
    assert sorted(r.id for r in later.registrations()) == ["forever", "long"]
    remaining = later.expires_in(later.get("web", "long"))  # type: ignore[arg-type]
    assert remaining is not None and 390 < remaining <= 400
    assert [r["id"] for r in json.loads(state.read_text())["registrations"]] == ["long", "forever"]
    # a wall clock set back extends nothing past the ttl
    earlier = alone(RegistrationSource, Store(encode_group), str(state), clock=lambda: time.time() - 10_000)
    earlier.load()
    remaining = earlier.expires_in(earlier.get("web", "long"))  # type: ignore[arg-type]
    assert remaining is not None and remaining <= 500


# -- persistence ------------------------------------------------------------------------------------
async def test_a_restart_keeps_registrations_and_versions(state: Path) -> None:
    state.parent.mkdir()
    async with serving(state) as server:
        await server.put("web", "a", ep(1, weight=2, zone="z", metadata={"v": [1, "x", None, True, 1.5]}))
        await server.put("web", "b", {"address": "2001:db8::1", "port": 2, "health": "draining", "priority": 1})
        await server.put("api", "c", ep(3, ttl=300))
        await server.put("gone", "d", ep(4))
        await server.delete("gone", "d")
        versions = server.versions()
        regs = sorted((r.group, r.id, r.endpoint, r.ttl) for r in server.source.registrations())
    assert set(versions) == {"web", "api"}
    store = Store(encode_group)
    again = alone(RegistrationSource, store, str(state))
    assert not store.ready
    again.load()
    assert store.ready
    assert sorted((r.group, r.id, r.endpoint, r.ttl) for r in again.registrations()) == regs
    assert {n: r.version for n, r in store.resources().items()} == versions
    reg = again.get("api", "c")
    assert reg is not None and 299 < (again.expires_in(reg) or 0) <= 300


async def test_first_start_writes_an_empty_state_file(state: Path) -> None:
    state.parent.mkdir()
    store = Store(encode_group)
    alone(RegistrationSource, store, str(state)).load()
    assert json.loads(state.read_text()) == {"version": 1, "registrations": []}
    assert store.ready and store.resources() == {}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"{not json", "not a valid state file"),
        (b"", "not a valid state file"),
        (b'{"version": 1}', "not a valid state file"),
        (b'{"version": 7, "registrations": []}', "version: 7 is not a known state file version"),
        (
            b'{"version": 1, "registrations": [{"group": "web", "id": "a", "endpoint": {"address": "10.0.0.1", '
            b'"port": 99999}}]}',
            "registrations[0].endpoint.port: 99999 is not a port",
        ),
        (
            b'{"version": 1, "registrations": [{"group": "web", "id": "a b", "endpoint": {}}]}',
            "registrations[0].id: ids are",
        ),
        (
            b'{"version": 1, "registrations": [{"group": "web", "id": "a", "ttl": 5, '
            b'"endpoint": {"address": "10.0.0.1", "port": 1}}]}',
            "registrations[0].expires_at: missing",
        ),
    ],
)
async def test_a_bad_state_file_stops_the_start(state: Path, content: bytes, expected: str) -> None:
    state.parent.mkdir()
    state.write_bytes(content)
    store = Store(encode_group)
    source = alone(RegistrationSource, store, str(state))
    with pytest.raises(RegistrationStateError) as e:
        source.load()
    assert str(state) in str(e.value) and expected in str(e.value)
    assert state.read_bytes() == content  # left for the operator to look at
    assert not store.ready


async def test_an_unwritable_state_directory_stops_the_start(tmp_path: Path) -> None:
    path = tmp_path / "missing-dir" / "state.json"
    with pytest.raises(RegistrationStateError, match=re.escape("missing-dir/state.json: cannot write")):
        alone(RegistrationSource, Store(encode_group), str(path)).load()


async def test_without_a_state_file_registrations_live_in_memory() -> None:
    async with serving(None) as server:
        assert (await server.put("web", "a", ep(1))).status == 201
        assert server.ports("web") == [1]
        assert server.source.writes == 0


# -- atomic, durable-first writes -------------------------------------------------------------------
async def test_a_failed_write_refuses_the_change_and_keeps_the_old_file(
    server: Server, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await server.put("web", "kept", ep(1))
    before = server.snapshot()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    for answer in (
        await server.put("web", "new", ep(2)),
        await server.put("web", "kept", ep(3)),
        await server.delete("web", "kept"),
    ):
        assert answer.status == 503 and "No space left" in answer.body["error"]
    assert server.snapshot() == before
    assert json.loads(state.read_text())["registrations"][0]["id"] == "kept"  # whole, and the old one
    assert sorted(os.listdir(state.parent)) == [state.name, f"{state.name}.lock"]  # no temp file left behind
    assert server.source.last_error is not None and "No space left" in server.source.last_error
    monkeypatch.undo()
    assert (await server.put("web", "new", ep(2))).status == 201
    assert server.source.last_error is None


async def test_the_store_changes_only_after_the_file_is_durable(
    server: Server, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[list[int], bytes]] = []
    replace, fsync = os.replace, os.fsync
    synced: list[str] = []  # what each fsync was of

    def watching_replace(src: str, dst: str) -> None:
        seen.append((server.ports("web"), Path(src).read_bytes()))
        assert os.path.abspath(src) in synced, "the temp file is fsynced before it is renamed"
        replace(src, dst)

    def counting_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "replace", watching_replace)
    monkeypatch.setattr(os, "fsync", counting_fsync)
    assert (await server.put("web", "a", ep(1))).status == 201
    ours = [(ports, data) for ports, data in seen if b'"id":"a"' in data]
    assert ours and ours[0][0] == []  # when the file was renamed into place, the store did not have it yet
    assert str(state.parent.resolve()) in synced  # the directory too, after the rename
    assert server.ports("web") == [1]


async def test_concurrent_changes_share_writes(server: Server) -> None:
    answers = await asyncio.gather(*(server.put("web", f"e{i}", ep(1000 + i)) for i in range(50)))
    assert [a.status for a in answers] == [201] * 50
    assert server.ports("web") == list(range(1000, 1050))
    assert server.source.writes < 50
    assert len(json.loads(Path(server.source.state_path or "").read_text())["registrations"]) == 50


# -- merged with the other sources ------------------------------------------------------------------
async def test_the_store_serves_the_union_with_other_sources(state: Path) -> None:
    state.parent.mkdir()
    store = Store(encode_group)
    store.add_source("file")
    store.update(
        "file",
        {
            "web": Group("web", (Endpoint("10.0.0.9", 80), Endpoint("10.0.0.1", 1, weight=7))),
            "static": Group("static", (Endpoint("10.0.0.8", 80),)),
        },
    )
    async with serving(state, store=store) as server:
        assert store.ready
        await server.put("web", "a", ep(2))
        await server.put("web", "b", ep(1, weight=1))  # also in the file: the first source wins
        await server.put("reg-only", "c", ep(3))
        web = store.get("web").group
        assert sorted((e.address, e.port, e.weight) for e in web.endpoints) == [
            ("10.0.0.1", 1, 7),
            ("10.0.0.1", 2, None),
            ("10.0.0.9", 80, None),
        ]
        assert store.sources_of("web") == ["file", "registrations"]
        assert store.sources_of("static") == ["file"]
        assert store.sources_of("reg-only") == ["registrations"]
        await server.delete("web", "a")
        await server.delete("web", "b")
        assert sorted(e.port for e in store.get("web").group.endpoints) == [1, 80]  # the file's stay


# -- hardening: scope, address policy, names, tokens, throttling, the temp file -----------------------
async def test_group_names_with_control_or_format_characters_are_refused(server: Server) -> None:
    for name in ("web%0Aforged%20line", "web%00", "web%E2%80%AEtxt.exe"):  # newline, NUL, RIGHT-TO-LEFT OVERRIDE
        before = server.snapshot()
        answer = await server.put(name, "a", ep(80))
        assert answer.status == 422 and answer.body["field"] == "group", (name, answer.body)
        assert server.snapshot() == before


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "::1", "169.254.169.254", "0.0.0.0", "::", "224.0.0.1", "::ffff:127.0.0.1", "fe80::1"]
)
async def test_loopback_link_local_unspecified_and_multicast_targets_are_refused(server: Server, address: str) -> None:
    answer = await server.put("web", "a", {"address": address, "port": 9901})
    assert answer.status == 422 and answer.body["field"] == "address"
    assert "--registration-allow-cidr" in answer.body["error"]


async def test_an_allowed_cidr_admits_loopback(state: Path) -> None:
    from eds_server.registration_api import RegistrationPolicy, parse_cidrs

    state.parent.mkdir()
    async with serving(state, api={"policy": RegistrationPolicy(allow=parse_cidrs(["127.0.0.0/8"]))}) as s:
        assert (await s.put("web", "a", {"address": "127.0.0.5", "port": 80})).status == 201
        assert (await s.put("web", "b", {"address": "169.254.169.254", "port": 80})).status == 422


async def test_scoped_tokens_write_only_their_groups(state: Path, tmp_path: Path) -> None:
    from eds_server.registration_api import RegistrationPolicy, load_scoped_tokens

    shop = "shop-token-0123456789"
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f'tokens:\n  - token: "{shop}"\n    groups: ["shop-*"]\n')
    state.parent.mkdir()
    policy = RegistrationPolicy(scoped_tokens=load_scoped_tokens(str(tokens)))
    async with serving(state, api={"policy": policy}) as s:
        auth = {"Authorization": f"Bearer {shop}"}
        assert (await s.put("shop-web", "a", ep(80), headers=auth)).status == 201
        denied = await s.put("billing", "a", ep(80), headers=auth)
        assert denied.status == 403 and denied.body["field"] == "group"
        assert (await s.delete("billing", "x", headers=auth)).status == 403
        assert (await s.put("billing", "a", ep(80))).status == 201  # the admin token writes every group


@pytest.mark.parametrize(
    "text",
    [
        'tokens:\n  - token: "short"\n    groups: ["a"]\n',
        'tokens:\n  - token: "long-enough-token-123"\n    groups: []\n',
        'tokens:\n  - token: "long-enough-token-123"\n    groups: ["a"]\n    name: ""\n',
        "tokens: {}\n",
        "nope: 1\n",
    ],
)
def test_bad_token_files_are_refused(tmp_path: Path, text: str) -> None:
    from eds_server.registration_api import RegistrationConfigError, load_scoped_tokens

    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    with pytest.raises(RegistrationConfigError):
        load_scoped_tokens(str(path))


async def test_a_short_admin_token_is_refused() -> None:
    from eds_server.registration_api import RegistrationConfigError

    with pytest.raises(RegistrationConfigError):
        async with serving(None, token="too-short"):
            pass


async def test_failed_authentications_are_throttled_per_address(state: Path) -> None:
    from eds_server.registration_api import RegistrationPolicy

    state.parent.mkdir()
    async with serving(state, api={"policy": RegistrationPolicy(auth_failures=5, auth_window=60)}) as s:
        wrong = {"Authorization": "Bearer wrong-token-0123456789"}
        statuses = [(await s.put("web", "a", ep(80), headers=wrong)).status for _ in range(8)]
        assert statuses == [401] * 5 + [429] * 3
        throttled = await s.put("web", "a", ep(80))  # even the right token, for a while
        assert throttled.status == 429 and int(throttled.headers["Retry-After"]) >= 1


def test_the_state_file_is_written_through_a_fresh_temp_file(tmp_path: Path) -> None:
    """A symlink planted at the old fixed temp name (or any name) is never written through."""
    from eds_server.sources.registrations import write_atomically

    target = tmp_path / "victim"
    target.write_text("untouched")
    state = tmp_path / "state.json"
    (tmp_path / "state.json.tmp").symlink_to(target)
    write_atomically(str(state), b"{}")
    assert state.read_bytes() == b"{}" and target.read_text() == "untouched"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.json.tmp", "victim"]  # no leftovers


def test_a_second_process_on_the_same_state_file_is_refused_naming_the_holder(state: Path) -> None:
    state.parent.mkdir()
    holder = alone(RegistrationSource, Store(encode_group), str(state))
    holder.load()
    code = (
        "import sys; from eds_server.store import Store; from eds_server.encode import encode_group\n"
        "from eds_server.sources.registrations import RegistrationSource, RegistrationStateError\n"
        "from eds_server.sources.aggregator import Aggregator\n"
        "feed = Aggregator(Store(encode_group)); source = RegistrationSource(feed, sys.argv[1])\n"
        "feed.declare([source.name])\n"
        "try:\n    source.load()\n"
        "except RegistrationStateError as e:\n    print(e); sys.exit(3)\n"
    )
    refused = subprocess.run([sys.executable, "-c", code, str(state)], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 3, refused.stderr
    assert f"in use by process {os.getpid()}" in refused.stdout and str(state) in refused.stdout
    holder.close()
    taken = subprocess.run([sys.executable, "-c", code, str(state)], capture_output=True, text=True, timeout=30)
    assert taken.returncode == 0, taken.stdout + taken.stderr


# -- the audit line of every write ------------------------------------------------------------------
def _audit(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "eds_server.audit"]


async def test_every_write_is_one_audit_line_with_who_what_and_the_result(
    state: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from eds_server.registration_api import RegistrationPolicy, load_scoped_tokens

    shop = "shop-token-0123456789"
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        f'tokens:\n  - {{token: "{shop}", groups: ["shop-*"], name: shop-ci}}\n'
        f'  - {{token: "other-token-0123456789", groups: ["x"]}}\n'
    )
    state.parent.mkdir()
    policy = RegistrationPolicy(scoped_tokens=load_scoped_tokens(str(tokens)))
    shop_auth = {"Authorization": f"Bearer {shop}"}
    caplog.set_level(logging.INFO, logger="eds_server.audit")
    async with serving(state, api={"policy": policy}) as s:
        assert (await s.put("shop-web", "a", ep(80, ttl=30), headers=shop_auth)).status == 201
        assert (await s.put("shop-web", "a", ep(80, ttl=30), headers=shop_auth)).status == 200
        assert (await s.put("shop-web", "a", ep(81, ttl=30), headers=shop_auth)).status == 200
        assert (await s.put("billing", "b", ep(80), headers=shop_auth)).status == 403
        assert (await s.put("web", "d", {"address": "10.0.0.9", "port": 0})).status == 422
        wrong, other = ({"Authorization": f"Bearer {t}-token-0123456789"} for t in ("wrong", "other"))
        assert (await s.put("web", "e", ep(90), headers=wrong)).status == 401
        assert (await s.put("x", "f", ep(91), headers=other)).status == 201
        assert (await s.delete("shop-web", "a", headers=shop_auth)).status == 204
    lines = _audit(caplog)
    got = [(r.method, r.result, r.group, r.id, r.token_name, r.address, r.port) for r in lines]  # type: ignore[attr-defined]
    assert got == [
        ("PUT", "created", "shop-web", "a", "shop-ci", "10.0.0.1", 80),
        ("PUT", "renewed", "shop-web", "a", "shop-ci", "10.0.0.1", 80),
        ("PUT", "updated", "shop-web", "a", "shop-ci", "10.0.0.1", 81),
        ("PUT", "403", "billing", "b", "shop-ci", None, None),
        ("PUT", "422", "web", "d", "admin", None, None),
        ("PUT", "401", "web", "e", None, None, None),
        ("PUT", "created", "x", "f", "tokens[1]", "10.0.0.1", 91),
        ("DELETE", "deleted", "shop-web", "a", "shop-ci", "10.0.0.1", 81),
    ]
    assert all(r.levelno == logging.INFO and r.peer == "127.0.0.1" for r in lines)  # type: ignore[attr-defined]
    assert lines[0].getMessage() == (
        "registration PUT created: group='shop-web' id='a' endpoint=10.0.0.1:80 token=shop-ci peer=127.0.0.1"
    )
    text = caplog.text
    assert shop not in text and TOKEN not in text and "wrong-token" not in text and "other-token" not in text


async def test_a_conflicting_write_is_audited_as_409(state: Path, caplog: pytest.LogCaptureFixture) -> None:
    state.parent.mkdir()
    caplog.set_level(logging.INFO, logger="eds_server.audit")
    async with serving(state) as s:
        assert (await s.put("web", "a", ep(80))).status == 201
        assert (await s.put("web", "b", ep(80))).status == 409
    refused = _audit(caplog)[-1]
    assert (refused.result, refused.status, refused.token_name, refused.address, refused.port) == (  # type: ignore[attr-defined]
        "409",
        409,
        "admin",
        "10.0.0.1",
        80,
    )


async def test_the_audit_line_has_fields_of_its_own_in_json_logs(state: Path, caplog: pytest.LogCaptureFixture) -> None:
    from eds_server.startup import JsonFormatter

    state.parent.mkdir()
    caplog.set_level(logging.INFO, logger="eds_server.audit")
    async with serving(state) as s:
        assert (await s.put("web", "a", {"address": "fd00::1", "port": 80})).status == 201
    line = json.loads(JsonFormatter().format(_audit(caplog)[-1]))
    assert {
        k: line[k]
        for k in (
            "event",
            "method",
            "result",
            "status",
            "group",
            "id",
            "address",
            "port",
            "token_name",
            "peer",
            "logger",
            "level",
        )
    } == {
        "event": "registration",
        "method": "PUT",
        "result": "created",
        "status": 201,
        "group": "web",
        "id": "a",
        "address": "fd00::1",
        "port": 80,
        "token_name": "admin",
        "peer": "127.0.0.1",
        "logger": "eds_server.audit",
        "level": "info",
    }
    assert "endpoint=[fd00::1]:80" in line["msg"] and TOKEN not in json.dumps(line)


async def test_a_real_server_writes_the_audit_line_as_json(tmp_path: Path) -> None:
    """Through the real logging set-up: `--log-format json`, the process's own log."""
    from tests.support.server_process import EdsServerProcess

    path = tmp_path / "upstreams.yaml"
    path.write_text("groups: {}\n")
    async with EdsServerProcess(
        path, "--state", str(tmp_path / "state.json"), "--admin-token", TOKEN, "--log-format", "json"
    ) as server:
        url = f"http://127.0.0.1:{server.admin_port}/v1/groups/web/endpoints/vm-1"
        async with aiohttp.ClientSession() as s:
            async with s.put(url, json=ep(8080), headers=AUTH) as r:
                assert r.status == 201
            async with s.put(url, json=ep(8080), headers={"Authorization": "Bearer not-the-token-012345"}) as r:
                assert r.status == 401
    lines = [json.loads(x) for x in server.log_text().splitlines() if '"eds_server.audit"' in x]
    assert [(x["result"], x["token_name"], x["address"], x["port"], x["peer"]) for x in lines] == [
        ("created", "admin", "10.0.0.1", 8080, "127.0.0.1"),
        ("401", None, None, None, "127.0.0.1"),
    ]
    assert all(x["level"] == "info" and x["id"] == "vm-1" and x["group"] == "web" for x in lines)
    assert TOKEN not in server.log_text() and "not-the-token" not in server.log_text()


async def test_a_health_check_is_registered_kept_across_a_restart_and_shown(state: Path) -> None:
    state.parent.mkdir()
    check = {
        "http": "/health",
        "interval": "1s",
        "timeout": "500ms",
        "unhealthy_threshold": 2,
        "expected_statuses": [200, "300-302"],
    }
    want = HealthSpec(
        "http",
        path="/health",
        interval=1.0,
        timeout=0.5,
        unhealthy_threshold=2,
        expected_statuses=((200, 200), (300, 302)),
    )
    async with serving(state) as s:
        answer = await s.put("web", "a", ep(80, health_check=check))
        assert answer.status == 201, answer.body
        assert answer.body["health_check"]["http"] == "/health"
        assert s.store.get("web").group.endpoints[0].check == want
    async with serving(state) as s:  # read back from the state file
        assert s.store.get("web").group.endpoints[0].check == want
