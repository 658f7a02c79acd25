"""Hand-assembled response bytes and our CLA encoding, read back by the official generated code."""

from __future__ import annotations

import dataclasses
import random

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st

from eds_server import protowire, upstreams
from eds_server.encode import Encoders, cluster_load_assignment, encode_group
from eds_server.encoded import Resource, content_version
from eds_server.model import Endpoint, Group, Health, Locality
from eds_server.pb.envoy.service.discovery.v3 import DiscoveryResponse
from eds_server.xds import wire
from eds_server.xds.common import EDS_TYPE_URL, ProtocolError
from tests.support.upstreams_files import DOCUMENTED


def resource(group: Group) -> Resource:
    body = encode_group(group)
    return Resource(group.name, content_version(body), body, group)


def test_response_bytes_match_official_parse_and_betterproto2() -> None:
    groups = upstreams.parse(DOCUMENTED)
    res = [resource(groups["web"]), resource(Group("empty"))]
    data = wire.discovery_response("v1", res, "42")
    official = discovery_pb2.DiscoveryResponse.FromString(data)
    assert official.version_info == "v1" and official.nonce == "42"
    assert official.type_url == EDS_TYPE_URL
    assert official.control_plane.identifier == wire.CONTROL_PLANE_ID
    assert [a.type_url for a in official.resources] == [EDS_TYPE_URL] * 2
    cla = endpoint_pb2.ClusterLoadAssignment()
    official.resources[0].Unpack(cla)
    assert json_format.MessageToDict(cla) == cluster_load_assignment(groups["web"]).to_dict()
    # and our own generated classes read the same message
    ours = DiscoveryResponse.parse(data)
    assert (ours.version_info, ours.nonce, ours.type_url) == ("v1", "42", EDS_TYPE_URL)
    assert [a.value for a in ours.resources] == [r.body for r in res]


def test_large_varints_and_empty_fields() -> None:
    big = Group("big", tuple(Endpoint(f"10.0.{i // 250}.{i % 250}", 1000 + i) for i in range(3000)))
    data = wire.discovery_response("", [resource(big)], "")
    official = discovery_pb2.DiscoveryResponse.FromString(data)
    assert official.version_info == "" and official.nonce == ""
    cla = endpoint_pb2.ClusterLoadAssignment()
    official.resources[0].Unpack(cla)
    assert len(cla.endpoints[0].lb_endpoints) == 3000


def test_encoding_is_canonical() -> None:
    a = Group("g", (Endpoint("10.0.0.2", 1), Endpoint("10.0.0.1", 1, priority=1), Endpoint("10.0.0.1", 2)))
    b = Group("g", tuple(reversed(a.endpoints)))
    assert encode_group(a) == encode_group(b)
    cla = endpoint_pb2.ClusterLoadAssignment.FromString(encode_group(a))
    assert [le.priority for le in cla.endpoints] == [0, 1]
    assert [e.endpoint.address.socket_address.address for e in cla.endpoints[0].lb_endpoints] == [
        "10.0.0.1",
        "10.0.0.2",
    ]


def test_node_id_and_cluster_read_off_the_wire() -> None:
    from envoy.config.core.v3 import base_pb2

    node = base_pb2.Node(id="envoy-1", cluster="edge", user_agent_name="envoy")
    for i in range(50):
        node.extensions.add(name=f"ext-{i}", category="c")
    node.metadata.fields["k"].string_value = "v" * 1000
    assert protowire.string_fields(node.SerializeToString(), {1, 2}) == {1: "envoy-1", 2: "edge"}
    assert protowire.string_fields(b"", {1, 2}) == {}
    # the official serializer writes fields in number order: the scan may stop past field 2
    raw = node.SerializeToString()
    assert protowire.string_fields(raw, {1, 2}, in_order=True) == {1: "envoy-1", 2: "edge"}
    assert protowire.string_fields(raw + b"\x0a\x01x", {1, 2}, in_order=True) == {1: "envoy-1", 2: "edge"}
    assert protowire.string_fields(
        base_pb2.Node(id="only-id", user_agent_name="envoy").SerializeToString(), {1, 2}, in_order=True
    ) == {1: "only-id"}


def test_metadata_order_does_not_change_the_version() -> None:
    a = Group("g", (Endpoint("10.0.0.1", 1, metadata={"a": 1, "b": {"x": 1, "y": 2}}),))
    b = Group("g", (Endpoint("10.0.0.1", 1, metadata={"b": {"y": 2, "x": 1}, "a": 1}),))
    assert encode_group(a) == encode_group(b)


def test_delta_response_bytes_match_official_parse() -> None:
    res = [resource(upstreams.parse(DOCUMENTED)["web"]), resource(Group("empty"))]
    data = wire.delta_discovery_response("sys-1", res, "7")
    official = discovery_pb2.DeltaDiscoveryResponse.FromString(data)
    assert (official.system_version_info, official.nonce, official.type_url) == ("sys-1", "7", EDS_TYPE_URL)
    assert official.control_plane.identifier == wire.CONTROL_PLANE_ID
    assert [(r.name, r.version) for r in official.resources] == [(r.name, r.version) for r in res]
    assert [r.resource.value for r in official.resources] == [r.body for r in res]
    assert [r.resource.type_url for r in official.resources] == [EDS_TYPE_URL] * 2


def random_group(rng: random.Random, name: str, n: int) -> Group:
    eps = []
    for i in range(n):
        eps.append(
            Endpoint(
                address=rng.choice([f"10.{i // 250}.{i % 250}.1", f"2001:db8::{i:x}"]),
                port=rng.randint(1, 65535),
                weight=rng.choice([None, 1, 7, 2**32 - 1]),
                health=rng.choice(list(Health)),
                priority=rng.choice([0, 0, 1, 128]),
                locality=rng.choice([Locality(), Locality("eu"), Locality("eu", "eu-1a", "r1")]),
                hostname=rng.choice(["", f"h{i}"]),
                metadata=rng.choice(
                    [{}, {"v": "2", "canary": True, "n": 1.5, "l": [1, "a"], "m": {"b": 1, "a": None}}]
                ),
            )
        )
    weights = rng.choice([{}, {Locality("eu"): 3}, {Locality(): 1, Locality("eu", "eu-1a", "r1"): 9}])
    return Group(name, tuple(eps), weights)


def test_cached_piece_encoding_equals_the_generated_classes() -> None:
    rng = random.Random(7)
    groups = [random_group(rng, f"g{i}", rng.randint(0, 40)) for i in range(200)]
    groups += [Group(""), Group("x", (Endpoint("0.0.0.0", 1),))]
    for g in groups:
        ours = endpoint_pb2.ClusterLoadAssignment.FromString(encode_group(g))
        generated = endpoint_pb2.ClusterLoadAssignment.FromString(bytes(cluster_load_assignment(g)))
        assert ours == generated, g.name


def test_a_present_but_empty_node_is_a_node() -> None:
    """`node {}` encodes as a zero-length field, which is still a node."""
    sotw = discovery_pb2.DiscoveryRequest(resource_names=["web"])
    sotw.node.SetInParent()
    req, node = wire.sotw_request(sotw.SerializeToString())
    assert req.has_node and node is not None and len(node) == 0
    delta = discovery_pb2.DeltaDiscoveryRequest(resource_names_subscribe=["web"])
    delta.node.SetInParent()
    dreq, dnode = wire.delta_request(delta.SerializeToString())
    assert dreq.has_node and dnode is not None
    assert not wire.sotw_request(discovery_pb2.DiscoveryRequest(resource_names=["web"]).SerializeToString())[0].has_node


def test_names_past_the_limit_stop_the_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request of 200,000 one-letter names is refused after reading max_names + 1 of them, not all."""
    calls = 0
    real_text = wire.text

    def counting_text(value: object) -> str:
        nonlocal calls
        calls += 1
        return real_text(value)  # type: ignore[arg-type]

    monkeypatch.setattr(wire, "text", counting_text)
    sotw = discovery_pb2.DiscoveryRequest(resource_names=["a"] * 200_000).SerializeToString()
    with pytest.raises(ProtocolError) as e:
        wire.sotw_request(sotw, max_names=10)
    assert e.value.status == "RESOURCE_EXHAUSTED" and "limit 10" in e.value.message
    assert calls <= 11
    for field in ("resource_names_subscribe", "resource_names_unsubscribe"):
        calls = 0
        delta = discovery_pb2.DeltaDiscoveryRequest(**{field: ["a"] * 200_000}).SerializeToString()
        with pytest.raises(ProtocolError):
            wire.delta_request(delta, max_names=10)
        assert calls <= 11
    initial = discovery_pb2.DeltaDiscoveryRequest(initial_resource_versions={str(i): "v" for i in range(1000)})
    with pytest.raises(ProtocolError):
        wire.delta_request(initial.SerializeToString(), max_names=10)
    assert (
        wire.sotw_request(discovery_pb2.DiscoveryRequest(resource_names=["a"] * 10).SerializeToString(), max_names=10)[
            0
        ].resource_names
        == ("a",) * 10
    )


def _outcome(parse: object, data: bytes) -> object:
    try:
        return parse(data, 3)  # type: ignore[operator]
    except Exception as e:  # the kind of refusal is what is compared
        return type(e)


def _requests() -> st.SearchStrategy[bytes]:
    """Well-formed DiscoveryRequests (Envoy's ACKs and more), as xds-protos encodes them."""
    text = st.text(max_size=20)
    return st.builds(
        lambda version, names, nonce, node, error: discovery_pb2.DiscoveryRequest(
            version_info=version,
            resource_names=names,
            type_url=EDS_TYPE_URL,
            response_nonce=nonce,
            **({"node": {"id": node}} if node is not None else {}),
            **({"error_detail": {"message": error}} if error is not None else {}),
        ).SerializeToString(),
        text,
        st.lists(text, max_size=5),
        text,
        st.none() | st.text(max_size=300),
        st.none() | text,
    )


@settings(max_examples=400, deadline=None)
@given(st.one_of(_requests(), st.binary(max_size=60), _requests().flatmap(lambda b: st.just(b[: len(b) // 2]))))
def test_the_plain_request_parse_agrees_with_the_general_one(data: bytes) -> None:
    """wire._sotw_plain, the ACK fast path, either declines (None) or reads exactly what the general
    parse reads; and sotw_request as a whole refuses what the general parse refuses."""
    plain = _outcome(wire._sotw_plain, data)
    general = _outcome(wire._sotw_request, data)
    if plain is not None:
        assert plain == general
    assert _outcome(wire.sotw_request, data) == general


def test_encoders_give_the_same_bytes_from_caches_of_their_own() -> None:
    """An App's Encoders agree with the uncached functions, and two of them share no cache."""
    groups = upstreams.parse(DOCUMENTED)
    one, two = Encoders(endpoint_cache_size=2), Encoders()
    for group in groups.values():
        fresh = dataclasses.replace(group, endpoints=tuple(dataclasses.replace(e) for e in group.endpoints))
        assert one.encode_group(group) == encode_group(fresh) == two.encode_group(fresh)
    res = [resource(groups["web"]), resource(Group("empty"))]
    assert one.responses.discovery_response("v1", res, "7") == wire.discovery_response("v1", res, "7")
    assert two.responses.delta_discovery_response("v1", res, "7") == wire.delta_discovery_response("v1", res, "7")
    assert one.resource_json(res[0]) == {"@type": EDS_TYPE_URL, **cluster_load_assignment(groups["web"]).to_dict()}
    assert one.resource_json(res[0]) is one.resource_json(res[0]) is not two.resource_json(res[0])
    assert one.responses.any_field(res[0]) is one.responses.any_field(res[0])
    assert two.responses.any_field(res[0]) is not one.responses.any_field(res[0])
