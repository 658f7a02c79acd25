"""The relay's pure parts: subscription bookkeeping, its wire messages, decoding what it relays, and
the store's withholding of names its upstream has not answered."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from grpclib.config import Configuration
from hypothesis import given, settings
from hypothesis import strategies as st

from eds_server.decode import DecodeError, decode_group
from eds_server.encode import encode_group
from eds_server.encoded import Resource
from eds_server.model import Endpoint, Group, Health, locality
from eds_server.pb.envoy.config.endpoint.v3 import ClusterLoadAssignment
from eds_server.pb.envoy.service.discovery.v3 import DeltaDiscoveryRequest
from eds_server.protowire import length_delimited, string_field
from eds_server.sources.relay import RelaySource, Subscriptions, UpstreamOptions, decode_response, encode_request
from eds_server.store import Store
from eds_server.transport.h2 import PassThroughCodec
from eds_server.xds import wire
from eds_server.xds.common import EDS_TYPE_URL
from eds_server.xds.delta import DeltaRequest, DeltaStream
from eds_server.xds.sotw import Request, SotwStream
from tests.support.feeds import alone
from tests.support.strategies import model_endpoints

EXAMPLES = settings(max_examples=200, deadline=None, database=None)


# -- subscriptions ---------------------------------------------------------------------------------
def test_union_of_names_told_once_and_dropped_after_the_linger() -> None:
    subs = Subscriptions(linger=10)
    subs.follow(["a", "b"], [], now=0)
    assert subs.request() == (["a", "b"], [])
    subs.follow(["b", "c"], [], now=1)  # b: a second stream; c: new
    assert subs.request() == (["c"], [])
    subs.follow([], ["a"], now=2)
    assert subs.request() == ([], []) and "a" in subs.wanted  # lingers: a reconnecting Envoy finds it
    assert subs.next_expiry(5) == 7
    subs.follow(["a"], [], now=5)  # back before the linger ran out: nothing to tell anyone
    assert subs.expire(100) == [] and subs.request() == ([], [])
    subs.follow([], ["a", "c"], now=100)
    assert subs.expire(109) == []
    assert sorted(subs.expire(110)) == ["a", "c"]
    assert subs.request() == ([], ["a", "c"])
    assert list(subs.wanted) == ["b"] and subs.next_expiry(110) is None


def test_a_reconnect_subscribes_everything_again_and_forgets_pending_removals() -> None:
    subs = Subscriptions(linger=0)
    subs.follow(["a", "b"], [], now=0)
    subs.request()
    subs.follow([], ["a"], now=1)
    assert subs.expire(1) == ["a"]
    subs.reconnected()  # the new stream never heard of a: no unsubscribe for it
    assert subs.request() == (["b"], [])


OPS = st.lists(
    st.tuples(st.sampled_from(["follow", "drop", "tick", "request", "reconnect"]), st.sampled_from("abcd")),
    max_size=40,
)


@EXAMPLES
@given(OPS)
def test_what_the_upstream_was_told_is_what_is_wanted(ops: list[tuple[str, str]]) -> None:
    """After each request on a connection, the names subscribed upstream (as it would count them)
    are exactly the wanted ones; followed names are always wanted; a name nobody followed for the
    whole linger is not."""
    subs = Subscriptions(linger=3)
    followers: dict[str, int] = {}
    last_follow: dict[str, float] = {}
    upstream: set[str] = set()
    now = 0.0
    for op, name in ops:
        if op == "follow":
            first = followers.get(name, 0) == 0
            followers[name] = followers.get(name, 0) + 1
            if first:
                subs.follow([name], [], now)
        elif op == "drop" and followers.get(name):
            followers[name] -= 1
            if followers[name] == 0:
                subs.follow([], [name], now)
                last_follow[name] = now
        elif op == "tick":
            now += 1
            subs.expire(now)
        elif op == "reconnect":
            subs.reconnected()
            upstream = set()
        subscribe, unsubscribe = subs.request()
        upstream |= set(subscribe)
        upstream -= set(unsubscribe)
        assert upstream == set(subs.wanted)
        assert {n for n, c in followers.items() if c} <= set(subs.wanted)
        for n in subs.wanted:
            assert followers.get(n) or now - last_follow[n] < 3


# -- the wire ----------------------------------------------------------------------------------------
def test_requests_parse_with_the_generated_classes() -> None:
    raw = encode_request(
        "relay-1",
        subscribe=["a", "b"],
        unsubscribe=["c"],
        initial_versions={"a": "v1"},
        nonce="7",
        error="bad",
        node=True,
    )
    req = DeltaDiscoveryRequest.parse(raw)
    assert req.node is not None and req.node.id == "relay-1"
    assert req.type_url == EDS_TYPE_URL
    assert (req.resource_names_subscribe, req.resource_names_unsubscribe) == (["a", "b"], ["c"])
    assert req.initial_resource_versions == {"a": "v1"}
    assert req.response_nonce == "7" and req.error_detail is not None and req.error_detail.message == "bad"


def test_responses_of_the_server_decode_to_names_versions_and_the_same_bytes() -> None:
    body = encode_group(Group("web", (Endpoint("10.0.0.1", 80),)))
    resource = Resource("web", "v9", body, Group("web"))
    received = decode_response(wire.delta_discovery_response("sys", [resource], "42"))
    assert received.resources == (("web", "v9", body),) and received.nonce == "42"


def test_a_response_of_another_type_is_refused() -> None:
    raw = wire.delta_discovery_response("sys", [], "1").replace(b"Assignment", b"Assignmenx")
    try:
        decode_response(raw)
    except DecodeError as e:
        assert "not EDS" in str(e)
    else:
        raise AssertionError("accepted")


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"", "without a type_url"),  # an empty gRPC message: no answer at all, not "nothing to serve"
        (string_field(5, "n1"), "without a type_url"),
        (string_field(4, EDS_TYPE_URL), "without a nonce"),
        (string_field(4, "type.googleapis.com/envoy.config.cluster.v3.Cluster") + string_field(5, "1"), "not EDS"),
        (b"\xff\xff\xff", "varint"),
        (
            string_field(4, EDS_TYPE_URL) + string_field(5, "1") + length_delimited(2, string_field(1, "v1")),
            "without a name",
        ),
        (string_field(4, EDS_TYPE_URL) + string_field(5, "1") + length_delimited(2, string_field(3, "web")), "no type"),
    ],
)
def test_what_is_not_a_well_formed_eds_answer_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_response(raw)


def test_an_assignment_under_another_name_is_refused() -> None:
    body = encode_group(Group("api", (Endpoint("10.0.0.1", 80),)))
    raw = wire.delta_discovery_response("sys", [Resource("web", "v1", body, Group("web"))], "1")
    with pytest.raises(DecodeError, match="for cluster 'api'"):
        decode_response(raw)
    truncated = wire.delta_discovery_response("sys", [Resource("web", "v1", body[:-3], Group("web"))], "1")
    with pytest.raises(ValueError):  # protowire says "truncated"
        decode_response(truncated)


def test_junk_is_nacked_never_loaded_and_said_once_then_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """A response that is not a real answer, or an answer for a name not asked for, is NACKed: the
    store stays unloaded (not ready), the reason is the source's last_error, and a flood of them
    logs a few lines, not one each."""
    store = Store(encode_group)
    relay = alone(RelaySource, store, UpstreamOptions("127.0.0.1", 1), codec=PassThroughCodec(), config=Configuration())
    body = encode_group(Group("web", (Endpoint("10.0.0.1", 80),)))
    unasked = wire.delta_discovery_response("sys", [Resource("web", "v1", body, Group("web"))], "1")
    with caplog.at_level(logging.WARNING, "eds_server.sources.relay"):
        for raw in [b"", unasked] * 50:
            _, nack = relay._take(raw)
            assert nack is not None
    assert relay.name in store.pending_sources and not store.ready
    status = relay.status()
    assert not status.loaded and status.last_error and "did not ask for: web" in status.last_error
    assert relay.nacks == 100 and len(caplog.records) <= 5
    relay.subs.follow(["web"], [], 0.0)
    relay.subs.request()  # told upstream: now an answer for it counts
    assert relay._take(unasked) == ("1", None)
    assert store.ready and relay.status().loaded


# -- decoding what is relayed ------------------------------------------------------------------------
@EXAMPLES
@given(
    st.lists(model_endpoints(), max_size=8, unique_by=lambda e: e.key),
    st.dictionaries(st.builds(locality, st.text(max_size=3)), st.integers(1, 1000), max_size=2),
)
def test_decoding_gives_back_the_encoded_group(endpoints: list[Endpoint], weights: dict[Any, int]) -> None:
    group = Group("web", tuple(endpoints), weights)
    body = encode_group(group)
    decoded = decode_group(body)
    assert encode_group(decoded) == body
    key = lambda e: (e.priority, e.locality, e.address, e.port)  # noqa: E731
    assert sorted(decoded.endpoints, key=key) == sorted(group.endpoints, key=key)
    used = {e.locality for e in endpoints}
    assert decoded.locality_weights == {loc: w for loc, w in weights.items() if loc in used}


def test_decoding_agrees_with_the_generated_classes() -> None:
    group = Group(
        "web",
        (
            Endpoint(
                "::1",
                8080,
                weight=3,
                health=Health.DRAINING,
                priority=1,
                locality=locality("eu", "a"),
                hostname="h",
                metadata={"v": "x"},
            ),
        ),
    )
    decoded = decode_group(bytes(ClusterLoadAssignment.parse(encode_group(group))))
    assert decoded == group


def test_garbage_is_a_decode_error() -> None:
    for raw in (b"\x12\x05\x12\x03\x0a\x01", b"\xff\xff", b"\x12\x02\x08\x01"):
        try:
            decode_group(raw)
        except DecodeError:
            continue
        raise AssertionError(f"decoded {raw!r}")


# -- the store of a relay ----------------------------------------------------------------------------
def _resource(name: str, version: str) -> Resource:
    group = Group(name, (Endpoint("10.0.0.1", 80),))
    return Resource(name, version, encode_group(group), group)


def test_store_withholds_what_the_upstream_has_not_answered_and_tells_of_interest() -> None:
    store = Store(encode_group)
    store.add_source("relay")
    store.withholds = True
    seen: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    store.interest = lambda added, removed: seen.append((added, removed))
    store.put_resources("relay", {})  # the first answer: ready, nothing held
    sotw, delta = SotwStream(store), DeltaStream(store)
    changed: list[frozenset[str] | None] = []
    store.follow(changed.append, ["a", "b"])
    store.follow(lambda names: None, ["b"])
    assert seen == [(("a", "b"), ())]
    sotw.receive(Request(has_node=True, resource_names=("a",), type_url=EDS_TYPE_URL))
    delta.receive(DeltaRequest(has_node=True, subscribe=("a",)))
    assert sotw.poll() is None and delta.poll() is None  # not an empty assignment: nothing
    store.put_resources("relay", {"a": _resource("a", "v1")})
    assert changed == [frozenset({"a"})]
    sotw.changed(changed[-1])
    delta.changed(changed[-1])
    sotw_response, delta_response = sotw.poll(), delta.poll()
    assert sotw_response is not None and [r.version for r in sotw_response.resources] == ["v1"]
    assert delta_response is not None and [r.version for r in delta_response.resources] == ["v1"]
    store.put_resources("relay", {"a": _resource("a", "v1")})  # the same version: no news
    assert changed == [frozenset({"a"})]
    store.unfollow(changed.append)
    assert seen[-1] == ((), ("a",))  # b is still followed
