"""Our .proto subset (proto/) and its generated code (eds_server/pb/).

* the committed generated code is what `make protos` produces now;
* every message, enum and service we define matches its upstream counterpart
  (xds-protos, googleapis, grpclib's grpc.health.v1) field by field;
* messages encoded by either side decode to the same thing on the other, and
  betterproto2's JSON mapping matches google.protobuf.json_format;
* our hand-written request decoders (eds_server.xds.wire) read what the official code encodes,
  and keep the Node as its exact bytes.
"""

from __future__ import annotations

import datetime
import importlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any as AnyType

import betterproto2
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor, FileDescriptor

from eds_server.pb.envoy.config.core.v3 import (
    Address,
    BuildVersion,
    ControlPlane,
    EnvoyInternalAddress,
    Extension,
    HealthStatus,
    Locality,
    Metadata,
    Node,
    Pipe,
    SocketAddress,
    SocketAddressProtocol,
)
from eds_server.pb.envoy.config.endpoint.v3 import (
    ClusterLoadAssignment,
    ClusterLoadAssignmentPolicy,
    ClusterLoadAssignmentPolicyDropOverload,
    Endpoint,
    EndpointAdditionalAddress,
    EndpointHealthCheckConfig,
    LbEndpoint,
    LocalityLbEndpoints,
    LocalityLbEndpointsLbEndpointList,
)
from eds_server.pb.envoy.service.discovery.v3 import (
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
    DiscoveryRequest,
    DiscoveryResponse,
    DynamicParameterConstraints,
    DynamicParameterConstraintsConstraintList,
    DynamicParameterConstraintsSingleConstraint,
    DynamicParameterConstraintsSingleConstraintExists,
    Resource,
    ResourceCacheControl,
    ResourceError,
    ResourceLocator,
    ResourceName,
)
from eds_server.pb.envoy.service.endpoint.v3 import EndpointDiscoveryServiceBase
from eds_server.pb.envoy.type.v3 import (
    FractionalPercent,
    FractionalPercentDenominatorType,
    SemanticVersion,
)
from eds_server.pb.google.protobuf import Any, Duration, Struct
from eds_server.pb.google.rpc import Status
from eds_server.pb.grpc.health.v1 import HealthBase
from eds_server.pb.grpc.reflection.v1 import ServerReflectionBase
from eds_server.pb.message_pool import default_message_pool
from eds_server.pb.xds.core.v3 import ContextParams
from eds_server.xds import wire
from tests.support.paths import ROOT

REPO = ROOT  # the repository
PROTO_DIR = REPO / "proto"
PB_DIR = REPO / "eds_server" / "pb"
GEN_SCRIPT = REPO / "scripts" / "gen_protos.py"

# Upstream generated code (official descriptors, C protobuf runtime). Imported by
# name so that they register in the default descriptor pool; classes are then
# looked up by full proto name (see `up`).
UPSTREAM_MODULES = (
    "envoy.config.core.v3.address_pb2",
    "envoy.config.core.v3.base_pb2",
    "envoy.config.core.v3.health_check_pb2",
    "envoy.config.endpoint.v3.endpoint_components_pb2",
    "envoy.config.endpoint.v3.endpoint_pb2",
    "envoy.service.discovery.v3.discovery_pb2",
    "envoy.service.endpoint.v3.eds_pb2",
    "envoy.type.v3.percent_pb2",
    "envoy.type.v3.semantic_version_pb2",
    "google.rpc.status_pb2",
    "grpclib.health.v1.health_pb2",
    "grpclib.reflection.v1.reflection_pb2",
    "xds.core.v3.context_params_pb2",
)
for _module in UPSTREAM_MODULES:
    importlib.import_module(_module)
UPSTREAM_POOL = descriptor_pool.Default()

# Our files whose upstream copy is registered under another path.
UPSTREAM_FILE_ALIASES = {
    "grpc/health/v1/health.proto": "grpclib/health/v1/health.proto",
    "grpc/reflection/v1/reflection.proto": "grpclib/reflection/v1/reflection.proto",
}

# Upstream fields that our subset deliberately leaves out (in messages we do define).
EXPECTED_OMISSIONS = {
    # Needs LedsClusterLocalityConfig -> ConfigSource -> most of core/v3.
    ("envoy.config.endpoint.v3.LocalityLbEndpoints", "leds_cluster_locality_config"),
}

STALE_HINT = "eds_server/pb/ is out of date with proto/: run `make protos` and commit the result"


def up(full_name: str) -> AnyType:
    """The upstream (xds-protos / googleapis) message class for a proto full name."""
    return message_factory.GetMessageClass(UPSTREAM_POOL.FindMessageTypeByName(full_name))


def our_proto_files() -> list[str]:
    return sorted(p.relative_to(PROTO_DIR).as_posix() for p in PROTO_DIR.rglob("*.proto"))


# --------------------------------------------------------------------------
# Staleness of the committed generated code


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    out = tmp_path / "pb"
    # Run from an unrelated directory: the output must not depend on the cwd.
    proc = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"gen_protos.py failed:\n{proc.stdout}{proc.stderr}"

    fresh, committed = _tree(out), _tree(PB_DIR)
    missing = sorted(fresh.keys() - committed.keys())
    extra = sorted(committed.keys() - fresh.keys())
    differ = sorted(k for k in fresh.keys() & committed.keys() if fresh[k] != committed[k])
    assert not (missing or extra or differ), (
        f"{STALE_HINT}\n  missing: {missing}\n  not generated any more: {extra}\n  differ: {differ}"
    )


# --------------------------------------------------------------------------
# Descriptor cross-check against the upstream descriptors


@pytest.fixture(scope="module")
def our_pool(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pool.DescriptorPool:
    """Our .proto files compiled by protoc into a private descriptor pool."""
    out = tmp_path_factory.mktemp("descriptors") / "ours.pb"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",  # adds its bundled google/protobuf include path
            f"--proto_path={PROTO_DIR}",
            "--include_imports",
            f"--descriptor_set_out={out}",
            *our_proto_files(),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    pool = descriptor_pool.DescriptorPool()
    for file_proto in descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file:
        pool.Add(file_proto)
    return pool


def _our_files(pool: descriptor_pool.DescriptorPool) -> list[FileDescriptor]:
    return [pool.FindFileByName(name) for name in our_proto_files()]


def _messages(file: FileDescriptor) -> Iterator[Descriptor]:
    def walk(desc: Descriptor) -> Iterator[Descriptor]:
        yield desc
        for nested in desc.nested_types:
            yield from walk(nested)

    for desc in file.message_types_by_name.values():
        yield from walk(desc)


def _enums(file: FileDescriptor) -> Iterator[EnumDescriptor]:
    yield from file.enum_types_by_name.values()
    for msg in _messages(file):
        yield from msg.enum_types


def _counterpart_name(full_name: str) -> str:
    """Full name of the upstream counterpart of one of our messages or enums."""
    return full_name


def _field_signature(field: FieldDescriptor) -> dict[str, AnyType]:
    ref = field.message_type or field.enum_type
    return {
        "number": field.number,
        "type": field.type,
        "repeated": field.is_repeated,
        "type_name": _counterpart_name(ref.full_name) if ref else None,
        "oneof": field.containing_oneof.name if field.containing_oneof else None,
        "presence": field.has_presence,
        "json_name": field.json_name,
        "deprecated": field.GetOptions().deprecated,
    }


def _upstream_file_name(ours: str) -> str:
    return UPSTREAM_FILE_ALIASES.get(ours, ours)


def test_proto_files_compile_without_foreign_imports(our_pool: descriptor_pool.DescriptorPool) -> None:
    ours = set(our_proto_files())
    for file in _our_files(our_pool):
        for dep in file.dependencies:
            assert dep.name in ours or dep.name.startswith("google/protobuf/"), (file.name, dep.name)


def test_messages_match_upstream(our_pool: descriptor_pool.DescriptorPool) -> None:
    omitted: set[tuple[str, str]] = set()
    checked = 0
    for file in _our_files(our_pool):
        for msg in _messages(file):
            upstream = UPSTREAM_POOL.FindMessageTypeByName(_counterpart_name(msg.full_name))
            if upstream.full_name == msg.full_name:
                assert upstream.file.name == _upstream_file_name(file.name), msg.full_name
            assert msg.GetOptions().map_entry == upstream.GetOptions().map_entry, msg.full_name

            for field in msg.fields:
                where = f"{msg.full_name}.{field.name}"
                assert field.name in upstream.fields_by_name, f"{where} has no upstream counterpart"
                theirs = upstream.fields_by_name[field.name]
                assert _field_signature(field) == _field_signature(theirs), where
                checked += 1
            omitted |= {(msg.full_name, name) for name in set(upstream.fields_by_name) - set(msg.fields_by_name)}
    assert omitted == EXPECTED_OMISSIONS
    assert checked > 100


def test_enums_match_upstream(our_pool: descriptor_pool.DescriptorPool) -> None:
    enums = [enum for file in _our_files(our_pool) for enum in _enums(file)]
    assert {e.full_name for e in enums} >= {
        "envoy.config.core.v3.HealthStatus",
        "envoy.config.core.v3.SocketAddress.Protocol",
        "envoy.type.v3.FractionalPercent.DenominatorType",
        "grpc.health.v1.HealthCheckResponse.ServingStatus",
    }
    for enum in enums:
        upstream = UPSTREAM_POOL.FindEnumTypeByName(enum.full_name)
        ours = {v.name: v.number for v in enum.values}
        theirs = {v.name: v.number for v in upstream.values}
        assert ours == theirs, enum.full_name


def test_services_match_upstream(our_pool: descriptor_pool.DescriptorPool) -> None:
    services = [s for file in _our_files(our_pool) for s in file.services_by_name.values()]
    assert {s.full_name for s in services} == {
        "envoy.service.endpoint.v3.EndpointDiscoveryService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    }
    for service in services:
        upstream = UPSTREAM_POOL.FindServiceByName(service.full_name)

        def sig(s: AnyType) -> dict[str, tuple[str, str, bool, bool]]:
            return {
                m.name: (
                    m.input_type.full_name,
                    m.output_type.full_name,
                    m.client_streaming,
                    m.server_streaming,
                )
                for m in s.methods
            }

        assert sig(service) == sig(upstream), service.full_name


@pytest.mark.parametrize(
    ("base", "service_name"),
    [
        (EndpointDiscoveryServiceBase, "envoy.service.endpoint.v3.EndpointDiscoveryService"),
        (HealthBase, "grpc.health.v1.Health"),
        (ServerReflectionBase, "grpc.reflection.v1.ServerReflection"),
    ],
)
def test_generated_servicer_paths_and_types(base: type, service_name: str) -> None:
    upstream = UPSTREAM_POOL.FindServiceByName(service_name)
    mapping = base().__mapping__()
    assert set(mapping) == {f"/{service_name}/{m.name}" for m in upstream.methods}
    for method in upstream.methods:
        handler = mapping[f"/{service_name}/{method.name}"]
        streaming = (method.client_streaming, method.server_streaming)
        assert handler.cardinality.value == streaming
        urls = default_message_pool.type_to_url
        assert urls[handler.request_type] == f"type.googleapis.com/{method.input_type.full_name}"
        assert urls[handler.reply_type] == f"type.googleapis.com/{method.output_type.full_name}"


def test_every_message_registered_under_its_type_url(
    our_pool: descriptor_pool.DescriptorPool,
) -> None:
    registered = default_message_pool.url_to_type
    for file in _our_files(our_pool):
        for msg in _messages(file):
            if not msg.GetOptions().map_entry:
                assert f"type.googleapis.com/{msg.full_name}" in registered, msg.full_name


# --------------------------------------------------------------------------
# Wire and JSON cross-check with the upstream runtime
#
# Each case is built twice, independently: with our classes, and as the
# canonical proto3 JSON parsed by json_format into the upstream class.


def make_cla() -> ClusterLoadAssignment:
    return ClusterLoadAssignment(
        cluster_name="backend",
        endpoints=[
            LocalityLbEndpoints(
                locality=Locality(region="eu-west-1", zone="eu-west-1a", sub_zone="rack-7"),
                metadata=Metadata(filter_metadata={"com.example": Struct.from_dict({"tier": "gold"})}),
                lb_endpoints=[
                    LbEndpoint(
                        endpoint=Endpoint(
                            address=Address(socket_address=SocketAddress(address="10.0.0.1", port_value=8080)),
                            health_check_config=EndpointHealthCheckConfig(
                                port_value=9090, hostname="hc.backend.internal"
                            ),
                            hostname="backend-1.example.internal",
                        ),
                        health_status=HealthStatus.HEALTHY,
                        load_balancing_weight=10,
                        metadata=Metadata(
                            filter_metadata={
                                "envoy.lb": Struct.from_dict(
                                    {
                                        "version": "v1",
                                        "canary": False,
                                        "shard": 3,
                                        "tags": ["a", "b", 1.5, None, True],
                                        "limits": {"rps": 12.5, "burst": None},
                                    }
                                )
                            },
                            typed_filter_metadata={
                                "com.example.typed": Any.pack(Locality(region="typed")),
                            },
                        ),
                    ),
                    LbEndpoint(
                        endpoint=Endpoint(
                            address=Address(
                                socket_address=SocketAddress(address="2001:db8::1", port_value=443, ipv4_compat=True)
                            ),
                            hostname="backend-2.example.internal",
                            additional_addresses=[
                                EndpointAdditionalAddress(
                                    address=Address(socket_address=SocketAddress(address="10.0.0.2", port_value=443))
                                )
                            ],
                        ),
                        health_status=HealthStatus.DRAINING,
                        load_balancing_weight=1,
                    ),
                    LbEndpoint(endpoint_name="named-1", health_status=HealthStatus.DEGRADED),
                    LbEndpoint(
                        endpoint=Endpoint(address=Address(pipe=Pipe(path="/run/backend.sock", mode=0o600))),
                        health_status=HealthStatus.UNHEALTHY,
                    ),
                    LbEndpoint(
                        endpoint=Endpoint(
                            address=Address(
                                envoy_internal_address=EnvoyInternalAddress(
                                    server_listener_name="internal-listener", endpoint_id="ep-1"
                                )
                            )
                        ),
                        health_status=HealthStatus.TIMEOUT,
                    ),
                    LbEndpoint(
                        endpoint=Endpoint(
                            address=Address(
                                socket_address=SocketAddress(
                                    protocol=SocketAddressProtocol.UDP,
                                    address="dns.example.internal",
                                    named_port="dns",
                                    resolver_name="custom",
                                    network_namespace_filepath="/var/run/netns/ns1",
                                )
                            ),
                            health_check_config=EndpointHealthCheckConfig(
                                address=Address(socket_address=SocketAddress(address="::ffff:10.0.0.9", port_value=1)),
                                disable_active_health_check=True,
                            ),
                        ),
                    ),
                ],
                load_balancing_weight=100,
                proximity=2,
            ),
            LocalityLbEndpoints(
                locality=Locality(region="us-east-1", zone="us-east-1b"),
                lb_endpoints=[
                    LbEndpoint(
                        endpoint=Endpoint(
                            address=Address(socket_address=SocketAddress(address="fe80::1%eth0", port_value=0))
                        ),
                        health_status=HealthStatus.HEALTHY,
                        load_balancing_weight=128,
                    ),
                ],
                load_balancing_weight=50,
                priority=1,
            ),
            LocalityLbEndpoints(
                locality=Locality(region="ap-south-1"),
                lb_endpoints=[LbEndpoint(endpoint_name="named-1", load_balancing_weight=0)],
                load_balancing_weight=0,
                priority=2,
                proximity=0,
            ),
        ],
        named_endpoints={
            "named-1": Endpoint(
                address=Address(socket_address=SocketAddress(address="10.1.0.1", port_value=80)),
                hostname="named-1.example.internal",
            ),
        },
        policy=ClusterLoadAssignmentPolicy(
            drop_overloads=[
                ClusterLoadAssignmentPolicyDropOverload(
                    category="throttle",
                    drop_percentage=FractionalPercent(
                        numerator=5, denominator=FractionalPercentDenominatorType.TEN_THOUSAND
                    ),
                ),
                ClusterLoadAssignmentPolicyDropOverload(category="lb", drop_percentage=FractionalPercent(numerator=1)),
            ],
            overprovisioning_factor=140,
            endpoint_stale_after=datetime.timedelta(seconds=30, milliseconds=500),
            weighted_priority_health=True,
        ),
    )


def _sock(address: str, port: int) -> dict[str, AnyType]:
    return {"socketAddress": {"address": address, "portValue": port}}


CLA_JSON: dict[str, AnyType] = {
    "clusterName": "backend",
    "endpoints": [
        {
            "locality": {"region": "eu-west-1", "zone": "eu-west-1a", "subZone": "rack-7"},
            "metadata": {"filterMetadata": {"com.example": {"tier": "gold"}}},
            "lbEndpoints": [
                {
                    "endpoint": {
                        "address": _sock("10.0.0.1", 8080),
                        "healthCheckConfig": {"portValue": 9090, "hostname": "hc.backend.internal"},
                        "hostname": "backend-1.example.internal",
                    },
                    "healthStatus": "HEALTHY",
                    "loadBalancingWeight": 10,
                    "metadata": {
                        "filterMetadata": {
                            "envoy.lb": {
                                "version": "v1",
                                "canary": False,
                                "shard": 3,
                                "tags": ["a", "b", 1.5, None, True],
                                "limits": {"rps": 12.5, "burst": None},
                            }
                        },
                        "typedFilterMetadata": {
                            "com.example.typed": {
                                "@type": "type.googleapis.com/envoy.config.core.v3.Locality",
                                "region": "typed",
                            }
                        },
                    },
                },
                {
                    "endpoint": {
                        "address": {
                            "socketAddress": {
                                "address": "2001:db8::1",
                                "portValue": 443,
                                "ipv4Compat": True,
                            }
                        },
                        "hostname": "backend-2.example.internal",
                        "additionalAddresses": [{"address": _sock("10.0.0.2", 443)}],
                    },
                    "healthStatus": "DRAINING",
                    "loadBalancingWeight": 1,
                },
                {"endpointName": "named-1", "healthStatus": "DEGRADED"},
                {
                    "endpoint": {"address": {"pipe": {"path": "/run/backend.sock", "mode": 384}}},
                    "healthStatus": "UNHEALTHY",
                },
                {
                    "endpoint": {
                        "address": {
                            "envoyInternalAddress": {
                                "serverListenerName": "internal-listener",
                                "endpointId": "ep-1",
                            }
                        }
                    },
                    "healthStatus": "TIMEOUT",
                },
                {
                    "endpoint": {
                        "address": {
                            "socketAddress": {
                                "protocol": "UDP",
                                "address": "dns.example.internal",
                                "namedPort": "dns",
                                "resolverName": "custom",
                                "networkNamespaceFilepath": "/var/run/netns/ns1",
                            }
                        },
                        "healthCheckConfig": {
                            "address": _sock("::ffff:10.0.0.9", 1),
                            "disableActiveHealthCheck": True,
                        },
                    }
                },
            ],
            "loadBalancingWeight": 100,
            "proximity": 2,
        },
        {
            "locality": {"region": "us-east-1", "zone": "us-east-1b"},
            "lbEndpoints": [
                {
                    "endpoint": {"address": _sock("fe80::1%eth0", 0)},
                    "healthStatus": "HEALTHY",
                    "loadBalancingWeight": 128,
                }
            ],
            "loadBalancingWeight": 50,
            "priority": 1,
        },
        {
            "locality": {"region": "ap-south-1"},
            "lbEndpoints": [{"endpointName": "named-1", "loadBalancingWeight": 0}],
            "loadBalancingWeight": 0,
            "priority": 2,
            "proximity": 0,
        },
    ],
    "namedEndpoints": {"named-1": {"address": _sock("10.1.0.1", 80), "hostname": "named-1.example.internal"}},
    "policy": {
        "dropOverloads": [
            {
                "category": "throttle",
                "dropPercentage": {"numerator": 5, "denominator": "TEN_THOUSAND"},
            },
            {"category": "lb", "dropPercentage": {"numerator": 1}},
        ],
        "overprovisioningFactor": 140,
        "endpointStaleAfter": "30.500s",
        "weightedPriorityHealth": True,
    },
}

CLA_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def make_node(extensions: int = 3) -> Node:
    return Node(
        id="sidecar~10.0.0.7~web-1.default~default.svc.cluster.local",
        cluster="web",
        metadata=Struct.from_dict(
            {
                "ISTIO_VERSION": "1.22.0",
                "LABELS": {"app": "web", "version": "v2"},
                "CPU_LIMIT": 2.0,
                "ENABLED": True,
                "PORTS": [80, 443],
            }
        ),
        dynamic_parameters={"envoy.config.endpoint.v3.ClusterLoadAssignment": ContextParams(params={"zone": "a"})},
        locality=Locality(region="eu-west-1", zone="eu-west-1a"),
        user_agent_name="envoy",
        user_agent_build_version=BuildVersion(
            version=SemanticVersion(major_number=1, minor_number=36, patch=2),
            metadata=Struct.from_dict({"revision.sha": "0123abcd", "build.type": "RELEASE"}),
        ),
        extensions=[
            Extension(
                name=f"envoy.filters.http.ext_{i}",
                category="envoy.filters.http",
                version=BuildVersion(version=SemanticVersion(major_number=1)) if i == 0 else None,
                disabled=i == 1,
                type_urls=[f"envoy.extensions.filters.http.ext_{i}.v3.Config"],
            )
            for i in range(extensions)
        ],
        client_features=["envoy.lb.does_not_support_overprovisioning", "xds.config.resource-ttl"],
    )


def node_json(extensions: int = 3) -> dict[str, AnyType]:
    def ext(i: int) -> dict[str, AnyType]:
        out: dict[str, AnyType] = {
            "name": f"envoy.filters.http.ext_{i}",
            "category": "envoy.filters.http",
            "typeUrls": [f"envoy.extensions.filters.http.ext_{i}.v3.Config"],
        }
        if i == 0:
            out["version"] = {"version": {"majorNumber": 1}}
        if i == 1:
            out["disabled"] = True
        return out

    return {
        "id": "sidecar~10.0.0.7~web-1.default~default.svc.cluster.local",
        "cluster": "web",
        "metadata": {
            "ISTIO_VERSION": "1.22.0",
            "LABELS": {"app": "web", "version": "v2"},
            "CPU_LIMIT": 2.0,
            "ENABLED": True,
            "PORTS": [80, 443],
        },
        "dynamicParameters": {"envoy.config.endpoint.v3.ClusterLoadAssignment": {"params": {"zone": "a"}}},
        "locality": {"region": "eu-west-1", "zone": "eu-west-1a"},
        "userAgentName": "envoy",
        "userAgentBuildVersion": {
            "version": {"majorNumber": 1, "minorNumber": 36, "patch": 2},
            "metadata": {"revision.sha": "0123abcd", "build.type": "RELEASE"},
        },
        "extensions": [ext(i) for i in range(extensions)],
        "clientFeatures": ["envoy.lb.does_not_support_overprovisioning", "xds.config.resource-ttl"],
    }


def make_status() -> Status:
    return Status(
        code=3,
        message="cluster backend: invalid endpoint",
        details=[Any.pack(Duration(seconds=5, nanos=250_000_000)), Any.pack(ControlPlane(identifier="x"))],
    )


STATUS_JSON: dict[str, AnyType] = {
    "code": 3,
    "message": "cluster backend: invalid endpoint",
    "details": [
        {"@type": "type.googleapis.com/google.protobuf.Duration", "value": "5.250s"},
        {"@type": "type.googleapis.com/envoy.config.core.v3.ControlPlane", "identifier": "x"},
    ],
}


def make_discovery_request() -> DiscoveryRequest:
    return DiscoveryRequest(
        version_info="v41",
        node=make_node(),
        resource_names=["backend", "frontend"],
        resource_locators=[
            ResourceLocator(
                name="xdstp://example/envoy.config.endpoint.v3.ClusterLoadAssignment/backend",
                dynamic_parameters={"zone": "a"},
            )
        ],
        type_url=CLA_TYPE_URL,
        response_nonce="7",
        error_detail=make_status(),
    )


DISCOVERY_REQUEST_JSON: dict[str, AnyType] = {
    "versionInfo": "v41",
    "node": node_json(),
    "resourceNames": ["backend", "frontend"],
    "resourceLocators": [
        {
            "name": "xdstp://example/envoy.config.endpoint.v3.ClusterLoadAssignment/backend",
            "dynamicParameters": {"zone": "a"},
        }
    ],
    "typeUrl": CLA_TYPE_URL,
    "responseNonce": "7",
    "errorDetail": STATUS_JSON,
}


def make_discovery_response() -> DiscoveryResponse:
    return DiscoveryResponse(
        version_info="v42",
        resources=[
            Any.pack(make_cla()),
            Any.pack(ClusterLoadAssignment(cluster_name="frontend")),
        ],
        canary=True,
        type_url=CLA_TYPE_URL,
        nonce="8",
        control_plane=ControlPlane(identifier="eds-server/0.1.0"),
        resource_errors=[
            ResourceError(
                resource_name=ResourceName(name="gone"),
                error_detail=Status(code=5, message="not found"),
            )
        ],
    )


DISCOVERY_RESPONSE_JSON: dict[str, AnyType] = {
    "versionInfo": "v42",
    "resources": [
        {"@type": CLA_TYPE_URL, **CLA_JSON},
        {"@type": CLA_TYPE_URL, "clusterName": "frontend"},
    ],
    "canary": True,
    "typeUrl": CLA_TYPE_URL,
    "nonce": "8",
    "controlPlane": {"identifier": "eds-server/0.1.0"},
    "resourceErrors": [{"resourceName": {"name": "gone"}, "errorDetail": {"code": 5, "message": "not found"}}],
}


def make_delta_request() -> DeltaDiscoveryRequest:
    return DeltaDiscoveryRequest(
        node=make_node(),
        type_url=CLA_TYPE_URL,
        resource_names_subscribe=["backend", "frontend"],
        resource_names_unsubscribe=["old"],
        resource_locators_subscribe=[ResourceLocator(name="xdstp://a/b/c")],
        resource_locators_unsubscribe=[ResourceLocator(name="xdstp://a/b/d", dynamic_parameters={"k": "v"})],
        initial_resource_versions={"backend": "v3", "frontend": "v1"},
        response_nonce="9",
        error_detail=make_status(),
    )


DELTA_REQUEST_JSON: dict[str, AnyType] = {
    "node": node_json(),
    "typeUrl": CLA_TYPE_URL,
    "resourceNamesSubscribe": ["backend", "frontend"],
    "resourceNamesUnsubscribe": ["old"],
    "resourceLocatorsSubscribe": [{"name": "xdstp://a/b/c"}],
    "resourceLocatorsUnsubscribe": [{"name": "xdstp://a/b/d", "dynamicParameters": {"k": "v"}}],
    "initialResourceVersions": {"backend": "v3", "frontend": "v1"},
    "responseNonce": "9",
    "errorDetail": STATUS_JSON,
}


def make_delta_response() -> DeltaDiscoveryResponse:
    single = DynamicParameterConstraintsSingleConstraint
    return DeltaDiscoveryResponse(
        system_version_info="v43",
        resources=[
            Resource(
                name="backend",
                resource_name=ResourceName(
                    name="backend",
                    dynamic_parameter_constraints=DynamicParameterConstraints(
                        or_constraints=DynamicParameterConstraintsConstraintList(
                            constraints=[
                                DynamicParameterConstraints(constraint=single(key="zone", value="a")),
                                DynamicParameterConstraints(
                                    constraint=single(
                                        key="canary",
                                        exists=DynamicParameterConstraintsSingleConstraintExists(),
                                    )
                                ),
                                DynamicParameterConstraints(
                                    not_constraints=DynamicParameterConstraints(
                                        constraint=single(key="zone", value="b")
                                    )
                                ),
                            ]
                        )
                    ),
                ),
                aliases=["backend-alias"],
                version="v3",
                resource=Any.pack(make_cla()),
                ttl=datetime.timedelta(seconds=60),
                cache_control=ResourceCacheControl(do_not_cache=True),
                metadata=Metadata(filter_metadata={"com.example": Struct.from_dict({"k": "v"})}),
            ),
            Resource(
                name="frontend",
                version="v1",
                resource=Any.pack(ClusterLoadAssignment(cluster_name="frontend")),
            ),
        ],
        type_url=CLA_TYPE_URL,
        removed_resources=["old"],
        removed_resource_names=[ResourceName(name="older")],
        nonce="10",
        control_plane=ControlPlane(identifier="eds-server/0.1.0"),
        resource_errors=[ResourceError(resource_name=ResourceName(name="bad"), error_detail=Status(code=3))],
    )


DELTA_RESPONSE_JSON: dict[str, AnyType] = {
    "systemVersionInfo": "v43",
    "resources": [
        {
            "name": "backend",
            "resourceName": {
                "name": "backend",
                "dynamicParameterConstraints": {
                    "orConstraints": {
                        "constraints": [
                            {"constraint": {"key": "zone", "value": "a"}},
                            {"constraint": {"key": "canary", "exists": {}}},
                            {"notConstraints": {"constraint": {"key": "zone", "value": "b"}}},
                        ]
                    }
                },
            },
            "aliases": ["backend-alias"],
            "version": "v3",
            "resource": {"@type": CLA_TYPE_URL, **CLA_JSON},
            "ttl": "60s",
            "cacheControl": {"doNotCache": True},
            "metadata": {"filterMetadata": {"com.example": {"k": "v"}}},
        },
        {
            "name": "frontend",
            "version": "v1",
            "resource": {"@type": CLA_TYPE_URL, "clusterName": "frontend"},
        },
    ],
    "typeUrl": CLA_TYPE_URL,
    "removedResources": ["old"],
    "removedResourceNames": [{"name": "older"}],
    "nonce": "10",
    "controlPlane": {"identifier": "eds-server/0.1.0"},
    "resourceErrors": [{"resourceName": {"name": "bad"}, "errorDetail": {"code": 3}}],
}

# Our encoder writes fields in declaration order (and map entries in insertion
# order), upstream in field-number order (maps in hash order): the same message
# can be encoded to different bytes, which shows when comparing google.protobuf.Any
# payloads (compared as bytes). These helpers compare Any payloads decoded.


def _canonical_anys(msg: AnyType) -> AnyType:
    """Copy of an upstream message with every Any payload re-encoded deterministically."""
    out = type(msg)()
    out.CopyFrom(msg)
    _canonicalize(out)
    return out


def _canonicalize(msg: AnyType) -> None:
    if msg.DESCRIPTOR.full_name == "google.protobuf.Any":
        if msg.type_url:
            inner = up(msg.type_url.rpartition("/")[2]).FromString(msg.value)
            _canonicalize(inner)
            msg.value = inner.SerializeToString(deterministic=True)
        return
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].message_type is not None:
                for item in value.values():
                    _canonicalize(item)
        elif field.is_repeated:
            for item in value:
                _canonicalize(item)
        else:
            _canonicalize(value)


def _unpacked(value: AnyType) -> AnyType:
    """Our message as nested plain data, with Any payloads decoded."""
    if isinstance(value, Any):
        return ("Any", value.type_url, _unpacked(value.unpack()))
    if isinstance(value, betterproto2.Message):
        fields = {name: _unpacked(getattr(value, name)) for name in value.__dataclass_fields__}
        return (type(value).__name__, fields)
    if isinstance(value, list):
        return [_unpacked(item) for item in value]
    if isinstance(value, dict):
        return {key: _unpacked(item) for key, item in value.items()}
    return value


# (id, builder of ours, upstream full name, canonical proto3 JSON)
CASES: list[tuple[str, Callable[[], AnyType], str, dict[str, AnyType]]] = [
    ("cla", make_cla, "envoy.config.endpoint.v3.ClusterLoadAssignment", CLA_JSON),
    ("node", make_node, "envoy.config.core.v3.Node", node_json()),
    (
        "discovery_request",
        make_discovery_request,
        "envoy.service.discovery.v3.DiscoveryRequest",
        DISCOVERY_REQUEST_JSON,
    ),
    (
        "discovery_response",
        make_discovery_response,
        "envoy.service.discovery.v3.DiscoveryResponse",
        DISCOVERY_RESPONSE_JSON,
    ),
    ("delta_request", make_delta_request, "envoy.service.discovery.v3.DeltaDiscoveryRequest", DELTA_REQUEST_JSON),
    ("delta_response", make_delta_response, "envoy.service.discovery.v3.DeltaDiscoveryResponse", DELTA_RESPONSE_JSON),
]
CASE_IDS = [case[0] for case in CASES]


@pytest.mark.parametrize(("name", "build", "upstream_name", "canonical"), CASES, ids=CASE_IDS)
def test_ours_to_upstream(
    name: str, build: Callable[[], AnyType], upstream_name: str, canonical: dict[str, AnyType]
) -> None:
    expected = json_format.ParseDict(canonical, up(upstream_name)())
    decoded = up(upstream_name).FromString(bytes(build()))
    assert json_format.MessageToDict(decoded) == json_format.MessageToDict(expected)
    assert _canonical_anys(decoded) == _canonical_anys(expected)


@pytest.mark.parametrize(("name", "build", "upstream_name", "canonical"), CASES, ids=CASE_IDS)
def test_upstream_to_ours(
    name: str, build: Callable[[], AnyType], upstream_name: str, canonical: dict[str, AnyType]
) -> None:
    ours = build()
    data = json_format.ParseDict(canonical, up(upstream_name)()).SerializeToString()
    decoded = type(ours).parse(data)
    assert _unpacked(decoded) == _unpacked(ours)
    assert _unpacked(type(ours).FromString(data)) == _unpacked(ours)
    # ...and back: what we re-encode is what upstream sent.
    assert up(upstream_name).FromString(bytes(decoded)).SerializeToString(deterministic=True) == up(
        upstream_name
    ).FromString(data).SerializeToString(deterministic=True)


@pytest.mark.parametrize(("name", "build", "upstream_name", "canonical"), CASES, ids=CASE_IDS)
def test_json_mapping_matches_json_format(
    name: str, build: Callable[[], AnyType], upstream_name: str, canonical: dict[str, AnyType]
) -> None:
    ours = build()
    upstream = json_format.ParseDict(canonical, up(upstream_name)())
    assert ours.to_dict() == json_format.MessageToDict(upstream)
    assert json.loads(ours.to_json()) == json.loads(json_format.MessageToJson(upstream))
    # Parsing upstream's JSON gives the same message.
    from_dict = type(ours).from_dict(json_format.MessageToDict(upstream))
    assert _unpacked(from_dict) == _unpacked(ours)
    from_json = type(ours).from_json(json_format.MessageToJson(upstream))
    assert _unpacked(from_json) == _unpacked(ours)


def test_unknown_fields_survive_a_round_trip() -> None:
    """Fields left out of our subset are kept as unknown fields and re-encoded."""
    upstream_cls = up("envoy.config.endpoint.v3.LocalityLbEndpoints")
    upstream = json_format.ParseDict(
        {
            "priority": 1,
            "ledsClusterLocalityConfig": {"ledsCollectionName": "xdstp://a/b/c"},
        },
        upstream_cls(),
    )
    ours = LocalityLbEndpoints.parse(upstream.SerializeToString())
    assert ours.priority == 1
    assert upstream_cls.FromString(bytes(ours)) == upstream


def test_deprecated_fields_work_and_warn() -> None:
    with pytest.warns(DeprecationWarning, match="load_balancer_endpoints"):
        ours = LocalityLbEndpoints(
            load_balancer_endpoints=LocalityLbEndpointsLbEndpointList(lb_endpoints=[LbEndpoint(endpoint_name="x")])
        )
    with pytest.warns(DeprecationWarning, match="listening_addresses"):
        node = Node(listening_addresses=[Address(pipe=Pipe(path="/p"))])
    up_lle = up("envoy.config.endpoint.v3.LocalityLbEndpoints").FromString(bytes(ours))
    assert up_lle.WhichOneof("lb_config") == "load_balancer_endpoints"
    assert up_lle.load_balancer_endpoints.lb_endpoints[0].endpoint_name == "x"
    up_node = up("envoy.config.core.v3.Node").FromString(bytes(node))
    assert up_node.listening_addresses[0].pipe.path == "/p"


def test_oneof_zero_values_are_encoded() -> None:
    """A oneof member set to its zero value is still present (unlike a plain field)."""
    ours = SocketAddress(address="::", port_value=0)
    upstream = up("envoy.config.core.v3.SocketAddress").FromString(bytes(ours))
    assert upstream.WhichOneof("port_specifier") == "port_value"
    assert SocketAddress.parse(upstream.SerializeToString()).port_value == 0
    assert SocketAddress(address="::").port_value is None


# --------------------------------------------------------------------------
# Our request decoders (eds_server.xds.wire), against the official encoding


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def _raw_field(data: bytes, number: int) -> bytes | None:
    """Payload of the (last) length-delimited occurrence of a field in an encoded message."""
    found, pos = None, 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _read_varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _read_varint(data, pos)
            if key >> 3 == number:
                found = data[pos : pos + length]
            pos += length
        else:
            raise AssertionError(f"unexpected wire type {wire_type}")
    return found


@pytest.mark.parametrize(
    ("decode", "upstream_name", "node_field", "canonical"),
    [
        (wire.sotw_request, "envoy.service.discovery.v3.DiscoveryRequest", 2, DISCOVERY_REQUEST_JSON),
        (wire.delta_request, "envoy.service.discovery.v3.DeltaDiscoveryRequest", 1, DELTA_REQUEST_JSON),
    ],
    ids=["sotw", "delta"],
)
def test_request_decoders_read_the_official_encoding(
    decode: AnyType, upstream_name: str, node_field: int, canonical: dict[str, AnyType]
) -> None:
    upstream_cls = up(upstream_name)
    upstream = json_format.ParseDict({**canonical, "node": node_json(extensions=500)}, upstream_cls())
    data = upstream.SerializeToString()
    raw_node = _raw_field(data, node_field)
    assert raw_node is not None and len(raw_node) > 30_000

    request, node = decode(data)
    assert node is not None and bytes(node) == raw_node == upstream.node.SerializeToString()
    assert request.has_node and request.type_url == upstream.type_url
    assert request.response_nonce == upstream.response_nonce
    assert request.error_message == (upstream.error_detail.message if upstream.HasField("error_detail") else None)
    if decode is wire.sotw_request:
        assert request.version_info == upstream.version_info
        assert list(request.resource_names) == list(upstream.resource_names)
    else:
        assert list(request.subscribe) == list(upstream.resource_names_subscribe)
        assert list(request.unsubscribe) == list(upstream.resource_names_unsubscribe)
        assert dict(request.initial_versions) == dict(upstream.initial_resource_versions)

    upstream.ClearField("node")
    request, node = decode(upstream.SerializeToString())
    assert node is None and not request.has_node


@pytest.mark.parametrize("data", [b"\x0a\x05ab", b"\x1a\x02\xff\xfe", b"\x0b", b"\xff" * 11])
def test_request_decoders_refuse_malformed_input(data: bytes) -> None:
    for decode in (wire.sotw_request, wire.delta_request):
        with pytest.raises(ValueError):
            decode(data)
