"""TLS, mTLS and authorization on the gRPC port: the rules, grpclib clients in-process, and a real
Envoy against the real command line. Certificates are made per test (tests/support/tls.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from ssl import SSLContext
from typing import Any

import h2.exceptions
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from envoy.config.endpoint.v3 import endpoint_pb2
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import StreamTerminatedError

from eds_server.encode import encode_group
from eds_server.model import Endpoint, Group
from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.pb.envoy.service.discovery.v3 import (
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
    DiscoveryRequest,
    DiscoveryResponse,
)
from eds_server.pb.envoy.service.endpoint.v3 import EndpointDiscoveryServiceStub
from eds_server.pb.grpc.health.v1 import HealthCheckRequest, HealthStub
from eds_server.security import SecurityConfigError, parse_authz, server_ssl_context
from eds_server.store import Store
from eds_server.transport.grpc import EdsService, make_server
from eds_server.xds.common import EDS_TYPE_URL
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_binary, envoy_bootstrap
from tests.support.paths import ROOT
from tests.support.server_process import EdsServerProcess
from tests.support.tls import CertAuthority, Issued, client_context

STREAM = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
DELTA = "/envoy.service.endpoint.v3.EndpointDiscoveryService/DeltaEndpoints"
SHOP_URI = "spiffe://example.org/ns/shop/sa/envoy"
OTHER_URI = "spiffe://example.org/ns/other/sa/envoy"
SOURCE = "test"

AUTHZ = """\
rules:
  - match: {san_uri: "spiffe://example.org/ns/shop/*"}
    groups: ["shop-*", "common"]
  - match: {node_cluster: "shop", node_id: "shop-*"}    # without mTLS: what the client claims
    groups: ["shop-*"]
default: deny
"""


@dataclass(frozen=True)
class Pki:
    authority: CertAuthority
    ca: Path
    server: Issued  # DNS eds-server and localhost, IP 127.0.0.1
    shop: Issued  # SAN URI SHOP_URI
    other: Issued  # SAN URI OTHER_URI, same CA
    foreign: Issued  # SAN URI SHOP_URI, issued by another CA


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = CertAuthority("eds test CA", tmp_path / "pki")
    rogue = CertAuthority("rogue CA", tmp_path / "pki")
    return Pki(
        authority=ca,
        ca=ca.cert_path,
        server=ca.issue(tmp_path / "pki" / "server", dns=["eds-server", "localhost"], ips=["127.0.0.1"]),
        shop=ca.issue(tmp_path / "pki" / "shop", uris=[SHOP_URI]),
        other=ca.issue(tmp_path / "pki" / "other", uris=[OTHER_URI]),
        foreign=rogue.issue(tmp_path / "pki" / "foreign", uris=[SHOP_URI]),
    )


def group(name: str, *ports: int) -> Group:
    return Group(name, tuple(Endpoint("127.0.0.1", p) for p in ports))


def first(*names: str, node: str = "test-node", cluster: str = "test") -> DiscoveryRequest:
    return DiscoveryRequest(node=Node(id=node, cluster=cluster), resource_names=list(names), type_url=EDS_TYPE_URL)


def reply(resp: DiscoveryResponse, *names: str) -> DiscoveryRequest:
    return DiscoveryRequest(
        version_info=resp.version_info, resource_names=list(names), response_nonce=resp.nonce, type_url=EDS_TYPE_URL
    )


async def recv(stream: Any, timeout: float = 5.0) -> Any:
    msg = await asyncio.wait_for(stream.recv_message(), timeout)
    assert msg is not None
    return msg


async def denied(stream: Any) -> str:
    """The stream ends with PERMISSION_DENIED; its message.

    The status comes in trailers with no RST_STREAM after them (docs/xds-behaviour.md), so grpclib's
    client reports it as a GRPCError: from the first read if nothing was sent before, else from
    the trailers once the messages end.
    """
    try:
        msg = await asyncio.wait_for(stream.recv_message(), 5)
        if msg is not None:
            raise AssertionError("a response, not PERMISSION_DENIED")
        await stream.end()
        await asyncio.wait_for(stream.recv_trailing_metadata(), 5)
        raise AssertionError("status OK, not PERMISSION_DENIED")
    except GRPCError as e:
        status, message = e.status, e.message or ""
    assert status == Status.PERMISSION_DENIED, (status, message)
    return str(message)


def names_of(resp: DiscoveryResponse) -> list[str]:
    return [endpoint_pb2.ClusterLoadAssignment.FromString(r.value).cluster_name for r in resp.resources]


# -- the rules, without sockets ----------------------------------------------------------------


def cert_with(*sans: tuple[str, str]) -> dict[str, Any]:
    """What ssl's getpeercert() gives for a verified certificate (the parts that matter)."""
    return {"subject": ((("commonName", "x"),),), "subjectAltName": sans}


def test_rules_union_of_matching_rules_and_default() -> None:
    policy = parse_authz(AUTHZ + "  # a comment\n", "authz.yaml")
    shop = policy.for_client(cert_with(("URI", SHOP_URI)), "whatever", "whatever")
    assert [shop(n) for n in ("shop-web", "shop-api", "common", "common2", "other")] == [True] * 3 + [False] * 2
    # both rules: union (here the same groups); a client no rule matches gets the default (deny)
    both = policy.for_client(cert_with(("URI", SHOP_URI)), "shop-1", "shop")
    assert both("common") and both("shop-x")
    assert not any(policy.for_client(None, "shop-1", "other")(n) for n in ("shop-web", "common", ""))
    node_only = policy.for_client(None, "shop-1", "shop")  # all keys of a match must match
    assert node_only("shop-web") and not node_only("common")
    assert "rules 1" in str(node_only) and "no certificate" in str(node_only)
    allow = parse_authz(AUTHZ.replace("default: deny", "default: allow"))
    assert allow.for_client(None, "anyone", "")("anything")
    assert not allow.for_client(cert_with(("URI", SHOP_URI)), "", "")("anything")  # matched: its rules only


def test_patterns_star_only_dns_case_insensitive() -> None:
    policy = parse_authz(
        "rules:\n"
        '  - {match: {san_dns: "*.Shop.example"}, groups: ["a?b", "x.*"]}\n'
        '  - {match: {san_uri: "spiffe://example.org/*"}, groups: ["*"]}\n'
    )
    dns = policy.for_client(cert_with(("DNS", "envoy-1.shop.EXAMPLE")), "", "")
    assert dns("a?b") and not dns("acb") and dns("x.anything/at all") and not dns("xyz")
    assert not policy.for_client(cert_with(("DNS", "shop.example")), "", "")("a?b")  # `*.` needs a label
    assert policy.for_client(cert_with(("URI", "spiffe://example.org/ns/a/b")), "", "")("any-group")
    assert not policy.for_client(cert_with(("URI", "spiffe://example.org.evil/x")), "", "")("any-group")
    assert not policy.for_client(cert_with(("DNS", "spiffe://example.org/x")), "", "")("any-group")


def test_bad_authz_file_every_problem_with_its_line() -> None:
    text = (
        "rules:\n"
        "  - match: {san_url: spiffe://x}\n"  # 2
        "    groups: shop\n"  # 3
        "  - groups: [1]\n"  # 4
        "  - match: {}\n"  # 5
        "    groups: []\n"
        "    extra: 1\n"  # 7
        "default: maybe\n"  # 8
    )
    with pytest.raises(SecurityConfigError) as e:
        parse_authz(text, "authz.yaml")
    assert e.value.problems == [
        "authz.yaml:2: rules[0].match.san_url: unknown key (expected one of: san_uri, san_dns, node_id, node_cluster)",
        "authz.yaml:3: rules[0].groups: must be a list of patterns",
        "authz.yaml:4: rules[1].match: missing",
        "authz.yaml:4: rules[1].groups[0]: must be a non-empty string (quote it if it starts with *)",
        "authz.yaml:5: rules[2].match: names none of: san_uri, san_dns, node_id, node_cluster (use `default`)",
        "authz.yaml:7: rules[2].extra: unknown key (expected one of: match, groups)",
        "authz.yaml:8: default: must be one of: allow, deny",
    ]
    for bad, problem in [
        ("", "authz.yaml:1: empty file"),
        ("default: deny\n", "authz.yaml:1: rules: missing"),
        ("rules: [\n", "authz.yaml:2:1: not valid YAML"),
        ("rules: []\nrules: []\n", "duplicate key"),
    ]:
        with pytest.raises(SecurityConfigError) as e:
            parse_authz(bad, "authz.yaml")
        assert problem in e.value.problems[0], e.value.problems


def test_tls_files_that_cannot_be_loaded_are_named(pki: Pki, tmp_path: Path) -> None:
    def problem(cert: str, key: str | None, client_ca: str | None = None) -> str:
        with pytest.raises(SecurityConfigError) as e:
            server_ssl_context(cert, key, client_ca)
        [only] = e.value.problems
        return only

    cert, key = str(pki.server.cert), str(pki.server.key)
    missing = str(tmp_path / "missing.pem")
    assert problem(missing, key) == f"TLS certificate {missing}: No such file or directory"
    assert problem(cert, missing) == f"TLS key {missing}: No such file or directory"
    assert problem(key, key) == f"TLS certificate {key}: no PEM certificate in it"
    assert problem(cert, str(pki.shop.key)) == f"TLS key {pki.shop.key}: does not match the certificate {cert}"
    assert problem(cert, None) == f"TLS key {cert}: no usable PEM private key in it (give --tls-key)"
    assert problem(cert, key, key) == f"TLS client CA {key}: no PEM certificate in it"
    encrypted = tmp_path / "encrypted-key.pem"
    private = load_pem_private_key(pki.server.key.read_bytes(), None)
    encrypted.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    assert problem(cert, str(encrypted)) == f"TLS key {encrypted}: encrypted; give an unencrypted key"
    both = tmp_path / "both.pem"
    both.write_bytes(pki.server.cert.read_bytes() + pki.server.key.read_bytes())
    ctx = server_ssl_context(str(both), None, str(pki.ca))  # key in the certificate file is fine
    assert ctx.minimum_version.name == "TLSv1_2" and ctx.verify_mode.name == "CERT_REQUIRED"


# -- in-process server, grpclib clients -------------------------------------------------------


class Harness:
    def __init__(self, store: Store, service: EdsService, port: int) -> None:
        self.store, self.service, self.port = store, service, port
        self._channels: list[Channel] = []

    def channel(self, ssl: SSLContext | None = None) -> Channel:
        channel = Channel("127.0.0.1", self.port, ssl=ssl)
        self._channels.append(channel)
        return channel

    @contextlib.asynccontextmanager
    async def stream(self, channel: Channel, path: str = STREAM, delta: bool = False) -> AsyncIterator[Any]:
        """A stream, reset on exit; a PERMISSION_DENIED status (already seen by `denied`) is not raised again."""
        types = (DeltaDiscoveryRequest, DeltaDiscoveryResponse) if delta else (DiscoveryRequest, DiscoveryResponse)
        request = channel.request(path, Cardinality.STREAM_STREAM, *types)
        stream = await request.__aenter__()
        try:
            yield stream
        finally:
            try:
                with contextlib.suppress(h2.exceptions.StreamClosedError):  # both sides ended already
                    await stream.cancel()
                await request.__aexit__(None, None, None)
            except StreamTerminatedError:
                pass  # reset by the client's own cancel()
            except GRPCError as e:
                if e.status != Status.PERMISSION_DENIED:
                    raise


@contextlib.asynccontextmanager
async def serving(ssl: SSLContext | None, authz: str | None) -> AsyncIterator[Harness]:
    store = Store(encode_group)
    store.add_source(SOURCE)
    store.update(SOURCE, {"shop-web": group("shop-web", 1), "common": group("common", 2), "secret": group("secret", 3)})
    service = EdsService(store, send_timeout=1)
    if authz is not None:
        service.authorize = parse_authz(authz).for_client
    server = make_server(
        service,
        max_streams_per_connection=100,
        keepalive_time=30,
        keepalive_timeout=10,
        max_message_size=1 << 20,
        ssl=ssl,
    )
    await server.start("127.0.0.1", 0)
    harness = Harness(store, service, server.port)  # type: ignore[union-attr]
    try:
        yield harness
    finally:
        for channel in harness._channels:
            channel.close()
        service.stop()
        server.close()
        await server.wait_closed()


def mtls(pki: Pki) -> SSLContext:
    return server_ssl_context(str(pki.server.cert), str(pki.server.key), str(pki.ca))


async def test_mtls_client_with_a_certificate_is_served_others_are_refused(pki: Pki) -> None:
    async with serving(mtls(pki), None) as h:
        good = h.channel(client_context(pki.ca, pki.shop))
        async with h.stream(good) as stream:
            await stream.send_message(first("shop-web"))
            assert names_of(await recv(stream)) == ["shop-web"]
        for ssl in (client_context(pki.ca), client_context(pki.ca, pki.foreign), None):  # no cert, other CA, plain
            with pytest.raises((StreamTerminatedError, ConnectionError)):
                await asyncio.wait_for(HealthStub(h.channel(ssl)).check(HealthCheckRequest()), 5)
        assert h.service.counters.streams_opened == 1


async def test_client_refuses_a_server_its_ca_did_not_issue(pki: Pki, tmp_path: Path) -> None:
    async with serving(mtls(pki), None) as h:
        rogue = CertAuthority("client trusts this", tmp_path / "rogue")
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):  # ssl.SSLCertVerificationError
            await asyncio.wait_for(
                HealthStub(h.channel(client_context(rogue.cert_path, pki.shop))).check(HealthCheckRequest()), 5
            )


async def test_a_forbidden_name_ends_that_stream_only(pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "eds_server.grpc")
    async with serving(mtls(pki), AUTHZ) as h:
        channel = h.channel(client_context(pki.ca, pki.shop))  # one HTTP/2 connection for every stream
        async with h.stream(channel) as allowed:
            await allowed.send_message(first("shop-web", "common", node="envoy-7"))
            r1 = await recv(allowed)
            assert sorted(names_of(r1)) == ["common", "shop-web"]
            await allowed.send_message(reply(r1, "shop-web", "common"))
            async with h.stream(channel) as forbidden:
                await forbidden.send_message(first("shop-api", "secret", node="envoy-7"))
                message = await denied(forbidden)
                assert "secret" in message and "shop-api" not in message
            h.store.update(SOURCE, {"shop-web": group("shop-web", 1, 4), "common": group("common", 5)})
            r2 = await recv(allowed)  # the first stream is still served
            assert sorted(names_of(r2)) == ["common", "shop-web"]
            # a name added later on a live stream is checked too
            await allowed.send_message(reply(r2, "shop-web", "common", "secret"))
            await denied(allowed)
        assert h.service.counters.denied == 2
        [line, _] = [r.getMessage() for r in caplog.records if "PERMISSION_DENIED" in r.getMessage()]
        assert "node=envoy-7" in line and "secret" in line and "127.0.0.1:" in line and SHOP_URI in line


async def test_delta_and_fetch_are_checked(pki: Pki) -> None:
    async with serving(mtls(pki), AUTHZ) as h:
        other = h.channel(client_context(pki.ca, pki.other))  # same CA, no rule: default deny
        async with h.stream(other, DELTA, delta=True) as stream:
            await stream.send_message(
                DeltaDiscoveryRequest(node=Node(id="n"), type_url=EDS_TYPE_URL, resource_names_subscribe=["common"])
            )
            await denied(stream)
        shop = EndpointDiscoveryServiceStub(h.channel(client_context(pki.ca, pki.shop)))
        resp = await asyncio.wait_for(shop.fetch_endpoints(first("common")), 5)
        assert names_of(resp) == ["common"]
        with pytest.raises(GRPCError) as e:
            await asyncio.wait_for(shop.fetch_endpoints(first("common", "secret")), 5)
        assert e.value.status == Status.PERMISSION_DENIED
        assert h.service.counters.denied == 2


async def test_node_rules_without_tls() -> None:
    async with serving(None, AUTHZ) as h:
        channel = h.channel()
        async with h.stream(channel) as stream:
            await stream.send_message(first("shop-web", node="shop-3", cluster="shop"))
            assert names_of(await recv(stream)) == ["shop-web"]
        for node, cluster in [("shop-3", "other"), ("web-1", "shop"), ("", "shop")]:
            async with h.stream(channel) as stream:
                await stream.send_message(first("shop-web", node=node, cluster=cluster))
                await denied(stream)


# -- the real command line and a real Envoy ---------------------------------------------------


def mtls_transport_socket(tls_dir: Path, client_cert: bool = True) -> dict[str, Any]:
    """xds_cluster's transport_socket from the shipped envoy/envoy-mtls.yaml, reading from `tls_dir`."""
    text = (ROOT / "envoy" / "envoy-mtls.yaml").read_text().replace("/etc/envoy/tls/", f"{tls_dir}/")
    boot = yaml.safe_load(text)
    [xds] = [c for c in boot["static_resources"]["clusters"] if c["name"] == "xds_cluster"]
    socket: dict[str, Any] = xds["transport_socket"]
    if not client_cert:
        del socket["typed_config"]["common_tls_context"]["tls_certificates"]
    return socket


def envoy_tls_dir(tmp_path: Path, pki: Pki, client: Issued) -> Path:
    """The files envoy-mtls.yaml names, as they would be in /etc/envoy/tls."""
    d = tmp_path / "envoy-tls"
    d.mkdir()
    (d / "envoy.pem").write_bytes(client.cert.read_bytes())
    (d / "envoy-key.pem").write_bytes(client.key.read_bytes())
    (d / "server-ca.pem").write_bytes(pki.ca.read_bytes())
    return d


def tls_bootstrap(port: int, tls_dir: Path, clusters: list[str], client_cert: bool = True) -> dict[str, Any]:
    boot = envoy_bootstrap(port, [EdsCluster(c) for c in clusters], initial_fetch_timeout="1s")
    [xds] = [c for c in boot["static_resources"]["clusters"] if c["name"] == "xds_cluster"]
    xds["transport_socket"] = mtls_transport_socket(tls_dir, client_cert)
    return boot


def tls_args(pki: Pki) -> list[str]:
    return ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key), "--tls-client-ca", str(pki.ca)]


def has_envoy() -> bool:
    try:
        envoy_binary()
    except FileNotFoundError:
        return False
    return True


needs_envoy = pytest.mark.skipif(not has_envoy(), reason="no envoy binary")


@needs_envoy
@pytest.mark.envoy
async def test_real_envoy_over_mtls_with_authz(pki: Pki, tmp_path: Path) -> None:
    upstreams = tmp_path / "upstreams.yaml"
    upstreams.write_text(
        "groups:\n  shop-web: {endpoints: [127.0.0.1:9001, 127.0.0.1:9002]}\n  secret: {endpoints: [127.0.0.1:9003]}\n"
    )
    authz = tmp_path / "authz.yaml"
    authz.write_text(AUTHZ)
    async with EdsServerProcess(upstreams, *tls_args(pki), "--authz", str(authz)) as server:
        boot = tls_bootstrap(server.port, envoy_tls_dir(tmp_path, pki, pki.shop), ["shop-web", "secret"])
        async with EnvoyProcess(boot) as proxy:
            hosts = await proxy.wait_for(lambda: proxy.hosts("shop-web"), lambda h: len(h) == 2, timeout=15)
            assert sorted(h.port for h in hosts) == [9001, 9002]
            stats = await proxy.stats("xds_cluster.ssl.handshake")
            assert int(stats["cluster.xds_cluster.ssl.handshake"]) >= 1
            # its stream for "secret" is refused, on the same connection, without disturbing the other
            await proxy.wait_for(lambda: server.admin("/v1/stats"), lambda s: s["denied"] >= 1, timeout=10)
            assert await proxy.hosts("secret") == []
            upstreams.write_text("groups:\n  shop-web: {endpoints: [127.0.0.1:9001]}\n")
            await proxy.wait_for(lambda: proxy.hosts("shop-web"), lambda h: len(h) == 1, timeout=10)
    log = server.log_text()
    assert "PERMISSION_DENIED sotw stream: node=test-envoy" in log and "may not read secret" in log
    assert SHOP_URI in log


@needs_envoy
@pytest.mark.envoy
@pytest.mark.parametrize("case", ["client cert from another CA", "no client cert", "server cert for another name"])
async def test_real_envoy_and_server_refuse_each_other_without_the_right_certificate(
    pki: Pki, tmp_path: Path, case: str
) -> None:
    upstreams = tmp_path / "upstreams.yaml"
    upstreams.write_text("groups:\n  shop-web: {endpoints: [127.0.0.1:9001]}\n")
    client, server_args = pki.foreign, tls_args(pki)
    if case == "server cert for another name":  # envoy-mtls.yaml accepts only the DNS name eds-server
        client = pki.shop
        wrong = pki.authority.issue(tmp_path / "pki" / "wrong-name", dns=["not-eds-server"])
        server_args = ["--tls-cert", str(wrong.cert), "--tls-key", str(wrong.key), "--tls-client-ca", str(pki.ca)]
    async with EdsServerProcess(upstreams, *server_args) as server:
        tls_dir = envoy_tls_dir(tmp_path, pki, client)
        boot = tls_bootstrap(server.port, tls_dir, ["shop-web"], client_cert=case != "no client cert")
        async with EnvoyProcess(boot) as proxy:
            # Envoy keeps trying: wait for a few failed connections, then nothing must have got through
            stats = await proxy.wait_for(
                lambda: proxy.stats("^cluster.xds_cluster.(upstream_cx_connect_fail|ssl)"),
                lambda s: int(s.get("cluster.xds_cluster.upstream_cx_connect_fail", 0)) >= 2,
                timeout=15,
            )
            assert await proxy.hosts("shop-web") == []
            assert (await server.admin("/v1/stats"))["streams_opened"] == 0
            if case == "server cert for another name":
                assert int(stats.get("cluster.xds_cluster.ssl.fail_verify_san", 0)) >= 1


def serve(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eds_server", "serve", "--listen", "127.0.0.1:0", "--admin", "off", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_files_refuse_to_start(pki: Pki, tmp_path: Path) -> None:
    upstreams = tmp_path / "upstreams.yaml"
    upstreams.write_text("groups: {}\n")
    authz = tmp_path / "authz.yaml"
    authz.write_text("rules:\n  - match: {san_url: spiffe://x}\n    groups: [a]\n")
    out = serve("--upstreams", str(upstreams), "--authz", str(authz))
    assert out.returncode == 1, out.stderr
    assert f"{authz}:2: rules[0].match.san_url: unknown key" in out.stderr
    assert "not starting: fix the TLS or authorization settings" in out.stderr
    out = serve("--upstreams", str(upstreams), "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.shop.key))
    assert out.returncode == 1
    assert f"TLS key {pki.shop.key}: does not match the certificate {pki.server.cert}" in out.stderr
    out = serve("--upstreams", str(upstreams), "--tls-client-ca", str(pki.ca))
    assert out.returncode == 2 and "--tls-client-ca need --tls-cert" in out.stderr
    out = serve("--upstreams", str(upstreams), "--authz", str(authz), "--rest-listen", "127.0.0.1:0")
    assert out.returncode == 2 and "--authz does not cover --rest-listen" in out.stderr


@needs_envoy
@pytest.mark.envoy
def test_shipped_mtls_config_validates_with_certificates_in_place(pki: Pki, tmp_path: Path) -> None:
    """envoy/envoy-mtls.yaml needs its files to exist even to validate: give it some."""
    tls_dir = envoy_tls_dir(tmp_path, pki, pki.shop)
    config = tmp_path / "envoy-mtls.yaml"
    config.write_text((ROOT / "envoy" / "envoy-mtls.yaml").read_text().replace("/etc/envoy/tls/", f"{tls_dir}/"))
    cmd = [str(envoy_binary()), "--mode", "validate", "-c", str(config), "-l", "warning"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_glob_matching_is_linear_for_a_pathological_pair() -> None:
    """A regex backtracks on `*-*-*-prod` against a long name of dashes (1.3 s for 1,024
    characters); the glob matcher looks for each literal piece once, left to right."""
    from eds_server.security import Glob

    name = "-" * 1_000_000 + "x"
    for pattern in ("*-*-*-prod", "a*" * 50 + "b", "*-*-*-*-*-*-*-*-*-*-x"):
        glob = Glob(pattern)
        before = Glob.steps
        glob.match(name)
        assert Glob.steps - before <= pattern.count("*"), pattern  # one search per piece, never retried


def test_glob_agrees_with_a_regex_on_small_inputs() -> None:
    import re

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from eds_server.security import Glob

    @settings(max_examples=3000, deadline=None)
    @given(st.text("ab*-", max_size=8), st.text("ab-", max_size=10))
    def agree(pattern: str, name: str) -> None:
        regex = ".*".join(re.escape(p) for p in pattern.split("*"))
        assert Glob(pattern).match(name) == bool(re.fullmatch(regex, name, re.DOTALL)), (pattern, name)

    agree()
