"""The delta state machine, driven directly."""

from __future__ import annotations

import pytest

from eds_server.xds.common import (
    EDS_TYPE_URL,
    Ack,
    Nack,
    PhaseError,
    ProtocolError,
    StaleNonce,
    Subscribed,
    SubscriptionLimits,
)
from eds_server.xds.delta import TRANSITIONS, DeltaPhase, DeltaRequest, DeltaStep, DeltaStream
from tests.support.xds_view import View


def req(
    subscribe: tuple[str, ...] = (),
    unsubscribe: tuple[str, ...] = (),
    nonce: str = "",
    error: str | None = None,
    node: bool = False,
    initial: dict[str, str] | None = None,
) -> DeltaRequest:
    return DeltaRequest(
        has_node=node,
        type_url=EDS_TYPE_URL,
        subscribe=subscribe,
        unsubscribe=unsubscribe,
        initial_versions=initial or {},
        response_nonce=nonce,
        error_message=error,
    )


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


def test_wildcard_is_no_resource_but_is_answered(view: View) -> None:
    """EDS has no wildcard: "*" (or nothing) on the first request gets one empty answer, never a CLA named "*"."""
    s = DeltaStream(view)
    s.receive(req(("*",), node=True))
    r = s.poll()
    assert r is not None and r.resources == () and not s.subscribed
    s.receive(req(("*", "web"), nonce=r.nonce))
    r2 = s.poll()
    assert r2 is not None and names(r2) == ["web"]


def test_acked_version_is_what_envoy_holds_not_what_it_rejected(view: View) -> None:
    """`acked` is the version the client holds: not one in flight, not one it rejected."""
    s = DeltaStream(view)
    s.receive(req(("web", "api"), node=True, initial={"api": "api-1"}))
    assert s.acked_version("api") == "api-1"  # what a reconnecting client says it has
    r1 = s.poll()
    assert r1 is not None and names(r1) == ["web"]
    assert s.acked_version("web") is None  # in flight, nothing held yet
    s.receive(req(nonce=r1.nonce))
    assert s.acked_version("web") == "web-1"
    view.set("web", b"web-bad")
    s.changed({"web"})
    r2 = s.poll()
    assert r2 is not None
    assert s.acked_version("web") == "web-1"  # in flight: Envoy still holds web-1
    s.receive(req(nonce=r2.nonce, error="bad"))
    assert s.acked_version("web") == "web-1" and s.nacked == {"web": "web-bad"}


@pytest.mark.parametrize("before", [False, True])
def test_subscribe_and_unsubscribe_of_one_name_in_one_request(view: View, before: bool) -> None:
    """Subscribes apply first, then unsubscribes; the events say the same net change."""
    s = DeltaStream(view)
    s.receive(req(("web", "api") if before else ("api",), node=True))
    events = s.receive(req(("web",), ("web",)))
    assert list(s.subscribed) == ["api"]
    assert events == ([Subscribed((), ("web",))] if before else [])
    r = s.poll()
    assert r is not None and names(r) == ["api"]


def test_max_names_is_a_total_per_stream(view: View) -> None:
    """--max-names counts every name a stream follows, across its requests."""
    s = DeltaStream(view, SubscriptionLimits(max_names=10))
    s.receive(req(tuple(f"n{i}" for i in range(6)), node=True))
    s.receive(req(tuple(f"n{i}" for i in range(6, 10))))
    with pytest.raises(ProtocolError) as e:
        s.receive(req(("n10",)))
    assert e.value.status == "RESOURCE_EXHAUSTED"
    s = DeltaStream(view, SubscriptionLimits(max_names=10))
    s.receive(req(tuple(f"n{i}" for i in range(10)), node=True))
    s.receive(req(("n10",), ("n0",)))  # swapping one for another stays within the limit
    assert len(s.subscribed) == 10


def test_reconnect_names_are_counted_once(view: View) -> None:
    """6 names subscribed with their 6 versions is 6 names, not 12."""
    many = tuple(f"n{i}" for i in range(6))
    s = DeltaStream(view, SubscriptionLimits(max_names=10))
    s.receive(req(many, node=True, initial={n: "x" for n in many}))
    assert len(s.subscribed) == 6


def test_resubscribing_a_rejected_name_answers_it(view: View) -> None:
    """Subscribing again to a rejected name answers it: the protocol says the server must still provide the resource."""
    s = DeltaStream(view)
    s.receive(req(("web",), node=True))
    r1 = s.poll()
    assert r1 is not None
    s.receive(req(nonce=r1.nonce, error="bad"))
    assert s.poll() is None  # not resent on its own
    s.receive(req(("web",)))
    r2 = s.poll()
    assert r2 is not None and names(r2) == ["web"]


def test_a_rejected_bundle_is_sorted_out_one_resource_at_a_time(view: View) -> None:
    """The good one of a rejected pair is resent and accepted; the bad one is not resent."""
    s = DeltaStream(view)
    s.receive(req(("web", "api"), node=True))
    r1 = s.poll()
    assert r1 is not None
    s.receive(req(nonce=r1.nonce))
    view.set("web", b"web-2")
    view.set("api", b"api-bad")
    s.changed({"web", "api"})
    r2 = s.poll()
    assert r2 is not None and names(r2) == ["web", "api"]
    s.receive(req(nonce=r2.nonce, error="api is bad"))
    seen = []
    for _ in range(4):  # bounded
        r = s.poll()
        if r is None:
            break
        assert len(r.resources) == 1
        seen.append(names(r)[0])
        s.receive(req(nonce=r.nonce, error="api is bad" if names(r) == ["api"] else None))
    assert seen == ["web", "api"]
    assert s.acked == {"web": "web-2", "api": "api-1"} and s.nacked == {"api": "api-bad"}
    view.set("web", b"web-3")
    view.set("api", b"api-3")
    s.changed({"web", "api"})
    r3 = s.poll()
    assert r3 is not None and names(r3) == ["web", "api"]  # bundled again once it is sorted out


def test_the_phases_move_through_their_table_and_nothing_else_moves_them(view: View) -> None:
    """Every transition of delta's TRANSITIONS taken by its step; a stale nonce and a change of
    subscriptions move nothing; a phase put out of step with what is in flight raises."""
    s = DeltaStream(view)
    assert s.phase is DeltaPhase.NEW and not s.wants_poll
    s.receive(req(subscribe=("web",), node=True))
    assert s.phase is TRANSITIONS[DeltaPhase.NEW, DeltaStep.FIRST] and s.wants_poll
    sent = s.poll()
    assert sent is not None and s.phase is TRANSITIONS[DeltaPhase.IDLE, DeltaStep.SEND] and not s.wants_poll
    s.receive(req(subscribe=("api",), nonce="stale"))  # a stale nonce, a new name: no move
    assert s.phase is DeltaPhase.IN_FLIGHT
    s.receive(req(nonce=sent.nonce))
    assert s.phase is TRANSITIONS[DeltaPhase.IN_FLIGHT, DeltaStep.ANSWER] and s.wants_poll  # api is due

    empty = DeltaStream(view)
    empty.receive(req(subscribe=("*",), node=True))
    assert empty.phase is TRANSITIONS[DeltaPhase.NEW, DeltaStep.FIRST_EMPTY] and empty.wants_poll
    answer = empty.poll()
    assert answer is not None and answer.resources == () and empty.phase is DeltaPhase.IN_FLIGHT

    broken = DeltaStream(view)
    broken.receive(req(subscribe=("web",), node=True))
    out = broken.poll()
    assert out is not None
    broken.phase = DeltaPhase.IDLE  # the bug: the response is still in flight
    with pytest.raises(PhaseError, match="ANSWER is no step from IDLE"):
        broken.receive(req(nonce=out.nonce))
