"""The delta state machine, driven directly."""

from __future__ import annotations

import pytest
from test_sotw import View

from eds_server.xds.common import EDS_TYPE_URL, Ack, Nack, ProtocolError, StaleNonce, Subscribed
from eds_server.xds.delta import DeltaRequest, DeltaStream


def req(subscribe: tuple[str, ...] = (), unsubscribe: tuple[str, ...] = (), nonce: str = "",
        error: str | None = None, node: bool = False, initial: dict[str, str] | None = None) -> DeltaRequest:
    return DeltaRequest(has_node=node, type_url=EDS_TYPE_URL, subscribe=subscribe, unsubscribe=unsubscribe,
                        initial_versions=initial or {}, response_nonce=nonce, error_message=error)  # fmt: skip


@pytest.fixture
def view() -> View:
    v = View()
    v.set("web", b"web-1")
    v.set("api", b"api-1")
    return v


def names(resp: object) -> list[str]:
    return [r.name for r in resp.resources]  # type: ignore[attr-defined]


def test_first_request_needs_node(view: View) -> None:
    with pytest.raises(ProtocolError):
        DeltaStream(view).receive(req(("web",)))


def test_subscribe_answers_known_and_unknown_with_per_resource_versions(view: View) -> None:
    s = DeltaStream(view)
    s.receive(req(("web", "nope"), node=True))
    r = s.poll()
    assert r is not None and names(r) == ["web", "nope"]
    assert [x.version for x in r.resources] == ["web-1", "empty:nope"]  # unknown: an empty CLA
    assert s.poll() is None


def test_initial_versions_skip_what_envoy_already_has(view: View) -> None:
    s = DeltaStream(view)
    s.receive(req(("web", "api"), node=True, initial={"web": "web-1", "api": "api-0"}))
    r = s.poll()
    assert r is not None and names(r) == ["api"]


def test_nothing_before_ready(view: View) -> None:
    view.ready = False
    s = DeltaStream(view)
    s.receive(req(("web",), node=True))
    assert s.poll() is None
    view.ready = True
    s.changed(None)
    assert s.poll() is not None


def test_only_changed_resources_are_sent_and_changes_coalesce(view: View) -> None:
    s = DeltaStream(view)
    s.receive(req(("web", "api"), node=True))
    r1 = s.poll()
    assert r1 is not None
    view.set("web", b"web-2")
    s.changed({"web"})
    view.set("web", b"web-3")
    s.changed({"web"})
    assert s.poll() is None  # in flight
    assert s.receive(req(nonce=r1.nonce)) == [Ack(r1.system_version_info, ("web", "api"))]
    r2 = s.poll()
    assert r2 is not None and names(r2) == ["web"] and r2.resources[0].version == "web-3"


def test_nack_is_not_resent_next_change_is(view: View) -> None:
    s = DeltaStream(view)
    s.receive(req(("web",), node=True))
    r1 = s.poll()
    assert r1 is not None
    s.receive(req(nonce=r1.nonce))
    view.set("web", b"web-bad")
    s.changed({"web"})
    r2 = s.poll()
    assert r2 is not None
    assert s.receive(req(nonce=r2.nonce, error="bad")) == [Nack(r2.system_version_info, ("web",), "bad")]
    s.changed({"web"})
    assert s.poll() is None
    view.set("web", b"web-good")
    s.changed({"web"})
    r3 = s.poll()
    assert r3 is not None and r3.resources[0].version == "web-good"


def test_subscription_changes_count_even_with_a_stale_nonce(view: View) -> None:
    s = DeltaStream(view)
    s.receive(req(("web",), node=True))
    r1 = s.poll()
    assert r1 is not None
    events = s.receive(req(("api",), ("web",), nonce="stale"))
    assert events == [StaleNonce("stale"), Subscribed(("api",), ("web",))]
    assert list(s.subscribed) == ["api"]
    assert s.in_flight is r1  # the stale request did not ACK anything
    s.receive(req(nonce=r1.nonce))
    r2 = s.poll()
    assert r2 is not None and names(r2) == ["api"]


def test_resubscribe_on_a_live_stream_is_always_answered(view: View) -> None:
    s = DeltaStream(view)
    s.receive(req(("web",), node=True))
    r1 = s.poll()
    assert r1 is not None
    s.receive(req(nonce=r1.nonce))
    s.receive(req(("web",)))  # again, unchanged
    r2 = s.poll()
    assert r2 is not None and names(r2) == ["web"]


def test_unsubscribed_names_are_not_pushed(view: View) -> None:
    s = DeltaStream(view)
    s.receive(req(("web", "api"), node=True))
    r1 = s.poll()
    assert r1 is not None
    s.receive(req((), ("api",), nonce=r1.nonce))
    view.set("api", b"api-2")
    s.changed({"api"})
    assert s.poll() is None


def test_removed_group_is_sent_as_empty_not_as_removal(view: View) -> None:
    s = DeltaStream(view)
    s.receive(req(("web",), node=True))
    r1 = s.poll()
    assert r1 is not None
    s.receive(req(nonce=r1.nonce))
    del view.bodies["web"]
    s.changed({"web"})
    r2 = s.poll()
    assert r2 is not None and r2.resources[0].body == b"empty:web"


def test_wildcard_is_ignored(view: View) -> None:
    s = DeltaStream(view)
    s.receive(req(("*",), node=True))
    assert s.poll() is None and not s.subscribed
