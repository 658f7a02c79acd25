"""The session driver (xds/session.py) without a socket: request bytes in, observer events and
store subscriptions out, responses polled."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from eds_server.encode import encode_group
from eds_server.observe import Observers, StreamObserver, StreamView
from eds_server.pb.envoy.service.discovery.v3 import DiscoveryResponse
from eds_server.store import Store
from eds_server.xds import wire
from eds_server.xds.common import Nonces, ProtocolError, SubscriptionLimits
from eds_server.xds.session import SOTW, SessionDriver
from tests.support.grpc_harness import SOURCE, first, group, reply


class Recorder(StreamObserver):
    def __init__(self) -> None:
        self.events: list[str] = []

    def opened(self, s: StreamView) -> None:
        self.events.append(f"opened {s.node} {list(s.subscribed)}")

    def ack(self, s: StreamView, names: Sequence[str]) -> None:
        self.events.append(f"ack {list(names)}")

    def nack(self, s: StreamView, names: Sequence[str], groups: Sequence[str], version: str, message: str) -> None:
        self.events.append(f"nack {list(groups)} {message}")

    def access_denied(self, s: StreamView | None, names: Sequence[str], why: str) -> None:
        self.events.append(f"denied {list(names)}")


def driver(store: Store, **kw: object) -> tuple[SessionDriver, Recorder]:
    recorder = Recorder()
    d = SessionDriver(
        SOTW, store, SubscriptionLimits(), Nonces(), Observers(recorder), "127.0.0.1:1", lambda: None, **kw
    )  # type: ignore[arg-type]
    return d, recorder


def store_with_web() -> Store:
    store = Store(encode_group)
    store.add_source(SOURCE)
    store.update(SOURCE, {"web": group("web", 8080)})
    return store


def test_a_request_subscribes_and_a_response_is_due() -> None:
    store = store_with_web()
    d, rec = driver(store)
    d.receive(bytes(first("web")), first=True)
    assert d.requested and d.node == "test-node" and rec.events == ["opened test-node ['web']"]
    response = d.sm.poll()
    assert response is not None and [r.name for r in response.resources] == ["web"]
    sent = DiscoveryResponse.parse(SOTW.encode(response, wire.Responses()))
    d.receive(bytes(reply(sent, "web")), first=False)
    assert rec.events[-1] == "ack ['web']"
    store.update(SOURCE, {"web": group("web", 8081)})
    d.on_change(frozenset({"web"}))
    changed = d.sm.poll()
    assert changed is not None and d.sm.poll() is None  # one response in flight
    rejected = reply(DiscoveryResponse.parse(SOTW.encode(changed, wire.Responses())), "web", error="bad")
    d.receive(bytes(rejected), first=False)
    assert rec.events[-1] == "nack ['web'] bad" and d.last_nack == "bad"


def test_garbage_and_denied_names_end_the_stream() -> None:
    store = store_with_web()
    d, _ = driver(store)
    with pytest.raises(ProtocolError) as e:
        d.receive(b"\xff\xff\xff", first=True)
    assert e.value.status == "INVALID_ARGUMENT"
    d, rec = driver(store, authorize=lambda cert, node, cluster: lambda name: name != "web")
    with pytest.raises(ProtocolError) as e:
        d.receive(bytes(first("web")), first=True)
    assert e.value.status == "PERMISSION_DENIED" and rec.events == ["denied ['web']"]
