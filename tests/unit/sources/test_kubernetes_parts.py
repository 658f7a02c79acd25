"""The Kubernetes source's parts, each on its own, without an API server: the configuration's
reloads, one watch read from a response, the view's publishing, the outage's words, and the
follow loop's answer to a 410.

The source as a whole, against a stand-in API server, is in test_kubernetes_recovery.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from eds_server.encode import encode_group
from eds_server.sources.aggregator import Aggregator
from eds_server.sources.base import Comeback, Liveness
from eds_server.sources.kubernetes_api import (
    SERVICES,
    SLICES,
    ApiError,
    Cursor,
    Gone,
    Requests,
    Stalled,
)
from eds_server.sources.kubernetes_config import Configuration
from eds_server.sources.kubernetes_follow import Follower
from eds_server.sources.kubernetes_liveness import ApiLiveness, Outage
from eds_server.sources.kubernetes_map import KubernetesOptions
from eds_server.sources.kubernetes_view import HeldView
from eds_server.store import Store
from tests.support.paths import DATA


def _kubeconfig(server: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": server}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        }
    )


async def test_the_configuration_is_loaded_again_once_per_rewrite_of_its_file(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(_kubeconfig("https://127.0.0.1:1"))
    hosts: list[str] = []
    config = Configuration(KubernetesOptions(kubeconfig=str(path)), "kubernetes", loaded=hosts.append)
    try:
        await config.reload()
        await config.reload(changed=True)  # nothing changed: not loaded again
        await config.reload()  # a 401 this soon after a load: not loaded again either
        assert config.loads == 1 and not config.changed()
        path.write_text(_kubeconfig("https://127.0.0.1:2"))  # rotated: another server
        assert config.changed()
        await config.reload(changed=True)
        await config.reload(changed=True)
        assert config.loads == 2 and not config.changed()
        assert hosts == ["https://127.0.0.1:1", "https://127.0.0.1:2"]
    finally:
        await config.close()


class _Response:
    """An API server's answer, its body read line by line; `silent`: then nothing more, ever."""

    def __init__(self, lines: list[dict[str, Any]], status: int = 200, silent: bool = False) -> None:
        self.status, self.lines, self.silent = status, lines, silent
        self.released = 0

    def release(self) -> None:
        self.released += 1

    async def read(self) -> bytes:
        return json.dumps({"message": "no"}).encode()

    @property
    def content(self) -> AsyncIterator[bytes]:
        async def lines() -> AsyncIterator[bytes]:
            for line in self.lines:
                yield json.dumps(line).encode() + b"\n"
                yield b"\n"  # a blank line between events is skipped
            if self.silent:
                await asyncio.Event().wait()

        return lines()


def _requests(resp: _Response, watch_timeout: int = 4) -> tuple[Requests, list[str]]:
    asked: list[str] = []

    async def call_api(path: str, method: str, **_: Any) -> _Response:
        asked.append(path)
        return resp

    config = SimpleNamespace(api=SimpleNamespace(call_api=call_api))
    heard: list[None] = []
    requests = Requests(config, lambda: heard.append(None), watch_timeout=watch_timeout)  # type: ignore[arg-type]
    return requests, asked


def _obj(version: str, name: str = "web") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", "resourceVersion": version}}


async def test_a_watch_applies_its_events_and_resumes_from_the_last_version_it_saw() -> None:
    resp = _Response(
        [
            {"type": "ADDED", "object": _obj("11")},
            {"type": "MODIFIED", "object": _obj("12")},
            {"type": "BOOKMARK", "object": _obj("15")},
        ]
    )
    requests, asked = _requests(resp)
    at, opened, events = Cursor("10"), [], []
    await requests.watch(SERVICES, "default", at, lambda: opened.append(1), lambda t, o: events.append(t))
    assert asked == ["/api/v1/namespaces/default/services"]
    assert opened == [1] and events == ["ADDED", "MODIFIED"]  # a bookmark moves the cursor only
    assert at.version == "15" and requests.watches_open == 0 and resp.released == 1


async def test_a_watch_error_event_is_gone_or_an_api_error() -> None:
    requests, _ = _requests(_Response([{"type": "ERROR", "object": {"code": 410, "message": "too old"}}]))
    with pytest.raises(Gone):
        await requests.watch(SLICES, None, Cursor("1"), lambda: None, lambda t, o: None)
    requests, _ = _requests(_Response([{"type": "ERROR", "object": {"code": 500, "message": "oops"}}]))
    with pytest.raises(ApiError) as raised:
        await requests.watch(SLICES, None, Cursor("1"), lambda: None, lambda t, o: None)
    assert raised.value.status == 500 and requests.watches_open == 0


async def test_a_watch_not_ended_when_asked_and_silent_is_stalled() -> None:
    at = Cursor("7")
    requests, _ = _requests(_Response([{"type": "ADDED", "object": _obj("8")}], silent=True), watch_timeout=0)
    with pytest.raises(Stalled, match="the watch's connection went silent"):
        await requests.watch(SERVICES, None, at, lambda: None, lambda t, o: None)
    assert at.version == "8" and requests.watches_open == 0


async def test_a_listing_refused_says_the_servers_message() -> None:
    requests, _ = _requests(_Response([], status=403))
    with pytest.raises(ApiError, match=r"GET /api/v1/services: 403: no$"):
        await requests.list(SERVICES, None)


class _Feed:
    """A feed that records what is published to it."""

    def __init__(self) -> None:
        self.published: list[set[str]] = []

    def publish(self, source: str, groups: Any) -> frozenset[str]:
        self.published.append(set(groups))
        return frozenset(groups)


async def test_the_view_publishes_only_once_every_scope_is_listed() -> None:
    feed = _Feed()
    held = HeldView(feed, "kubernetes", KubernetesOptions(namespaces=("a", "b")), debounce=0.01)  # type: ignore[arg-type]
    assert len(held.scopes) == 4  # Services and EndpointSlices, in each namespace
    stop = asyncio.Event()
    publisher = asyncio.create_task(held.publisher(stop))
    listed: dict[Any, list[Any]] = {}
    for kind, name in ((SERVICES, "service"), (SLICES, "slice-ipv4")):
        obj = json.loads((DATA / "kubernetes" / f"{name}.json").read_text())
        obj["metadata"]["namespace"] = "a"
        listed[(kind, "a")] = [obj]
    try:
        for i, (kind, ns) in enumerate(held.scopes):
            held.replace(kind, ns, listed.get((kind, ns), []))
            held.listed()
            for _ in range(20):  # the debounce, several times over
                await asyncio.sleep(0.01)
            assert len(feed.published) == (1 if i == len(held.scopes) - 1 else 0), (i, feed.published)
        assert held.loaded and feed.published == [{"web", "web-canary"}]  # the Service's two groups
    finally:
        stop.set()
        publisher.cancel()
        await asyncio.gather(publisher, return_exceptions=True)


def test_an_outage_is_said_once_and_again_when_its_nature_changes(caplog: pytest.LogCaptureFixture) -> None:
    store = Store(encode_group)
    feed = Aggregator(store)
    feed.declare(["kubernetes"])
    outage = Outage(Liveness(feed, "kubernetes", "the API server"))
    with caplog.at_level(logging.WARNING, "eds_server.sources"):
        outage.failed((SERVICES, None), "Services: down", 1.0, ConnectionRefusedError())
        outage.failed((SLICES, None), "EndpointSlices: down", 1.0, ConnectionRefusedError())
        outage.failed((SLICES, None), "EndpointSlices: refused (401)", 1.0, ApiError("401", 401))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "Services: down" in said[0] and "refused (401)" in said[1], said
    assert not outage.recovered((SERVICES, None)) and outage.recovered((SLICES, None))


async def test_a_backoff_ends_early_only_once_the_server_seen_away_answers() -> None:
    answers = [False, True]

    async def readyz() -> bool:
        return answers.pop(0)

    config = SimpleNamespace(changed=lambda: False, loads=1)
    health = ApiLiveness(
        Aggregator(Store(encode_group)),
        "kubernetes",
        SimpleNamespace(readyz=readyz, livez=readyz),  # type: ignore[arg-type]
        config,  # type: ignore[arg-type]
        probe_every=0.0,
    )
    comeback = Comeback()
    check = health.try_now(comeback, loads=1, probe=True)
    assert not await check()  # away
    assert await check()  # and back
    config.loads = 2  # a configuration loaded meanwhile: at once, with no probe
    assert await health.try_now(comeback, loads=1, probe=False)()
    assert health.probe.probes == 2


async def test_a_410_lists_the_kind_again_from_the_follow_loop(tmp_path: Path) -> None:
    stop = asyncio.Event()
    lists: list[str] = []
    watches: list[str | None] = []

    class Fake:
        watches_open = 0

        async def list(self, kind: Any, namespace: str | None) -> tuple[list[Any], str]:
            lists.append(kind.name)
            return [], str(10 * len(lists))

        async def watch(self, kind: Any, namespace: str | None, at: Cursor, opened: Any, event: Any) -> None:
            watches.append(at.version)
            opened()
            if len(watches) == 1:
                raise Gone()
            stop.set()  # ends the loop (a watch ended at once: the pause sees `stop`)

        async def livez(self) -> None: ...

        async def readyz(self) -> bool:
            return True

    feed = Aggregator(Store(encode_group))
    feed.declare(["kubernetes"])
    options = KubernetesOptions(kubeconfig=str(tmp_path / "kubeconfig"))
    config = Configuration(options, "kubernetes")
    requests: Any = Fake()
    health = ApiLiveness(feed, "kubernetes", requests, config)
    held = HeldView(feed, "kubernetes", options)
    follower = Follower("kubernetes", config, requests, health, held)
    await asyncio.wait_for(follower.follow(SERVICES, None, stop), 10)
    assert lists == ["Services", "Services"] and watches == ["10", "20"]
    assert follower.relists == 1 and follower.renewals == 0 and follower.reopened == 0
