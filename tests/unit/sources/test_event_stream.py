"""EventStream: the Docker event subscription renewed from the engine's own times, against a fake engine
that records each subscription's parameters and lets the test say what each one delivers."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiodocker
import pytest

from eds_server.sources.docker import MARGIN_NS, NS, EngineGone, EventStream, engine_ns, since_param

T0 = 1_765_000_000 * NS + 123_456_789  # the engine's clock at connect


class _Subscriber:
    def __init__(self, queue: asyncio.Queue[Mapping[str, Any] | None]) -> None:
        self.queue = queue

    async def get(self) -> Mapping[str, Any] | None:
        return await self.queue.get()


class FakeEvents:
    def __init__(self) -> None:
        self.params: list[dict[str, str]] = []  # one per subscription, in order
        self.queues: list[asyncio.Queue[Mapping[str, Any] | None]] = []
        self.stops = 0
        self.failure: Exception | None = None  # what stop() re-raises (a stream that failed)
        self.ahead: list[Mapping[str, Any] | None] = []  # what the next subscription delivers first

    def subscribe(self, **params: str) -> _Subscriber:
        self.params.append(params)
        self.queues.append(asyncio.Queue())
        for item in self.ahead:
            self.queues[-1].put_nowait(item)
        self.ahead = []
        return _Subscriber(self.queues[-1])

    async def stop(self) -> None:
        self.stops += 1
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure


class FakeSystem:
    async def info(self) -> Mapping[str, Any]:
        return {"SystemTime": "2025-12-06T05:46:40.123456789Z"}


class FakeDocker:
    def __init__(self) -> None:
        self.events = FakeEvents()
        self.system = FakeSystem()


def ev(ns: int, cid: str = "c1", action: str = "start") -> dict[str, Any]:
    return {"Type": "container", "Action": action, "Actor": {"ID": cid, "Attributes": {}}, "timeNano": ns}


async def stream(docker: FakeDocker, *, renew: float = 1000.0, answers: bool = True) -> EventStream:
    async def ping() -> object:
        if not answers:
            raise OSError("connection refused")
        return {}

    s = EventStream(docker, ("container",), renew=renew, ping=ping, timeout=1.0)  # type: ignore[arg-type]
    await s.open()
    return s


async def taken(s: EventStream, n: int) -> list[Mapping[str, Any] | None]:
    return [await s.get(0.01) for _ in range(n)]


def test_engine_times() -> None:
    assert engine_ns("2025-12-06T05:46:40.123456789Z") == T0
    assert engine_ns("2025-12-06T06:46:40.123456789+01:00") == T0  # the engine's local zone
    assert engine_ns("2025-12-06T05:46:40Z") == T0 - 123_456_789
    assert engine_ns("2025-12-06T05:46:40.5Z") == T0 - 123_456_789 + NS // 2
    assert engine_ns(None) is None and engine_ns("yesterday") is None
    assert since_param(T0) == "1765000000.123456789" and since_param(5 * NS + 7) == "5.000000007"


async def test_renewal_replays_from_the_last_event_and_skips_what_was_taken() -> None:
    docker = FakeDocker()
    s = await stream(docker)
    assert docker.events.params == [{"filters": '{"type": ["container"]}'}]  # the first: no `since`
    await s.renew_now()  # nothing taken yet: from the engine's clock at connect
    assert docker.events.params[-1]["since"] == since_param(T0 - MARGIN_NS)
    a, b = ev(T0 + 10), ev(T0 + 20, "c2")
    for e in (a, b):
        docker.events.queues[-1].put_nowait(e)
    assert await taken(s, 2) == [a, b]
    await s.renew_now()  # the old connection may have died after b: replay from b's time
    assert docker.events.params[-1]["since"] == since_param(T0 + 20 - MARGIN_NS)
    assert docker.events.stops == 2 and s.renewals == 2
    c = ev(T0 + 30, "c3")
    for e in (a, b, c):  # the replay (the margin reaches back to a), then news
        docker.events.queues[-1].put_nowait(e)
    assert await taken(s, 3) == [None, None, c]  # a and b were taken already
    assert not s.relist and s.gaps == 0


async def test_renewal_falls_due_by_itself() -> None:
    docker = FakeDocker()
    s = await stream(docker, renew=0.0)
    assert await s.get(1.0) is None
    assert s.renewals == 1 and len(docker.events.params) == 2


async def test_a_replay_that_does_not_reach_the_last_event_asks_for_a_relist() -> None:
    docker = FakeDocker()
    s = await stream(docker)
    docker.events.queues[-1].put_nowait(ev(T0 + 10))
    await taken(s, 1)
    await s.renew_now()
    later = ev(T0 + 50, "c9")  # the engine's history no longer holds T0 + 10: what came between is lost
    docker.events.queues[-1].put_nowait(later)
    assert await taken(s, 1) == [later]
    assert s.relist and s.gaps == 1


async def test_a_stream_that_ends_while_the_engine_answers_is_opened_afresh() -> None:
    docker = FakeDocker()
    s = await stream(docker)
    await s.renew_now()
    docker.events.queues[-1].put_nowait(None)  # the renewed stream ends (failed)
    docker.events.failure = aiodocker.DockerError(500, {"message": "no"})
    assert await s.get(1.0) is None  # no EngineGone: the engine answers
    assert s.renewals == 1 and s.reopened == 1 and s.relist
    assert "since" not in docker.events.params[-1]  # afresh: the engine may have restarted, its history lost


async def test_a_stream_that_ends_when_the_engine_does_not_answer_is_engine_gone() -> None:
    docker = FakeDocker()
    s = await stream(docker, answers=False)
    await s.renew_now()
    docker.events.queues[-1].put_nowait(None)
    with pytest.raises(EngineGone):
        await s.get(1.0)
    assert s.reopened == 0


async def test_a_fresh_stream_that_ends_is_a_reconnect() -> None:
    """Only a renewed stream is opened afresh: an engine that ends every stream meets the backoff."""
    docker = FakeDocker()
    s = await stream(docker)
    docker.events.queues[-1].put_nowait(None)  # the stream opened at connect ends
    with pytest.raises(EngineGone):
        await s.get(1.0)
    await s.renew_now()
    docker.events.queues[-1].put_nowait(None)
    assert await s.get(1.0) is None and s.reopened == 1  # a renewed one: opened afresh
    docker.events.queues[-1].put_nowait(None)  # and that fresh one ends too
    with pytest.raises(EngineGone):
        await s.get(1.0)
