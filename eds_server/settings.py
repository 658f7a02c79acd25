"""What one server runs with, grouped by the part each group configures. Made by the command line
(eds_server/options/, which validates what a user gives once, before anything starts), by the
`--workers` owner for itself and each worker (dataclasses.replace), and directly in code and tests;
the defaults here are the command line's (tests/unit/test_cli.py holds the two copies together).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .fields import MAX_UPSTREAMS_SIZE
from .registration_api import RegistrationPolicy
from .sources.containers import DockerOptions
from .sources.etcd_client import EtcdOptions
from .sources.kubernetes_map import KubernetesOptions
from .sources.registrations import MAX_REGISTRATIONS
from .sources.relay import UpstreamOptions
from .transport.h2 import ConnectionLimits, HttpLimits
from .xds.common import SubscriptionLimits

Address = tuple[str, int]


@dataclass(frozen=True)
class SourceSettings:
    """Where the groups come from (besides registrations): app.MERGE_ORDER lists the kinds."""

    upstreams: str | None = None  # the upstreams YAML file, followed as it changes
    max_upstreams_size: int = MAX_UPSTREAMS_SIZE
    docker: DockerOptions | None = None  # None: no Docker discovery
    swarm: DockerOptions | None = None  # None: no Swarm discovery (same engine options as Docker)
    docker_host: str | None = None  # None: DOCKER_HOST, else the local socket
    kubernetes: KubernetesOptions | None = None  # None: no Kubernetes discovery
    upstream_eds: UpstreamOptions | None = None  # a relay: groups from another eds-server, no other source
    debounce: float = 0.05
    startup_timeout: float | None = None  # None: answer nobody until every source has loaded


@dataclass(frozen=True)
class RegistrationSettings:
    """The registration API's source: where registrations are kept, and who may write them."""

    state: str | None = None  # the state file or etcd:// URL (None: kept in memory only)
    etcd: EtcdOptions = field(default_factory=EtcdOptions)  # TLS and auth for an etcd:// state
    admin_token: str | None = None  # turns the registration API's writes on
    max_registrations: int = MAX_REGISTRATIONS
    policy: RegistrationPolicy = field(default_factory=RegistrationPolicy)  # scoped tokens, CIDRs

    @property
    def wanted(self) -> bool:
        """Whether the server runs a registrations source at all."""
        return bool(self.state or self.admin_token or self.policy.scoped_tokens)


@dataclass(frozen=True)
class TransportSettings:
    """The ports Envoy reads (gRPC and REST), and what a client may take of them."""

    listen: Address = ("127.0.0.1", 18000)  # loopback unless told (as etcd, Consul): docs/security.md
    rest_listen: Address | None = None  # REST-JSON EDS, off unless asked for
    max_streams_per_connection: int = 10_000
    keepalive_time: float = 30.0
    keepalive_timeout: float = 10.0
    max_message_size: int = 4 * 1024 * 1024
    max_streams: int = 100_000
    send_timeout: float = 30.0
    reset_budget: int = 10_000
    limits: SubscriptionLimits = field(default_factory=SubscriptionLimits)
    # gRPC connections and per-IP budgets (its max_streams and reset_budget: the fields above)
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    http_limits: HttpLimits = field(default_factory=HttpLimits)  # admin and REST ports
    http2: str = "auto"  # which HTTP/2 path: auto, fast or stock (transport/h2/compat.py)
    shutdown_grace: float = 5.0  # --shutdown-timeout: SIGTERM to exit, however many streams are open


@dataclass(frozen=True)
class AdminSettings:
    """The operators' ports: the admin HTTP (status page, JSON, registration API) and the read-only one."""

    address: Address | None = ("127.0.0.1", 18001)  # None: no admin HTTP
    metrics_listen: Address | None = None  # read-only /metrics, /healthz, /readyz, off unless asked for
    tls_cert: str | None = None  # the admin port over TLS (--admin-tls: --tls-cert's file)
    tls_key: str | None = None  # its key (None: in tls_cert)


@dataclass(frozen=True)
class SecuritySettings:
    """TLS on the gRPC port and the authorization file: who may read which groups."""

    tls_cert: str | None = None  # PEM certificate chain: TLS on the gRPC port
    tls_key: str | None = None  # PEM private key (None: it is in tls_cert)
    tls_client_ca: str | None = None  # require client certificates issued by this CA (mTLS)
    authz: str | None = None  # authorization file: which groups a client may read

    def __post_init__(self) -> None:
        if (self.tls_key or self.tls_client_ca) and not self.tls_cert:  # the one place this is checked
            raise ValueError("--tls-key and --tls-client-ca need --tls-cert (EDS_TLS_CERT)")


@dataclass(frozen=True)
class WorkerSettings:
    """`--workers N`, and the sockets the owner and its workers serve each other on (set by workers.py)."""

    count: int = 1  # processes serving Envoy; 1: this one serves
    listen_fd: int | None = None  # serve gRPC on this inherited listening socket (a worker's, bound by its owner)
    admin_unix: str | None = None  # admin HTTP on this Unix socket instead (a worker's, read by its owner)
    listen_unix: str | None = None  # gRPC on this Unix socket instead (an owner's, for its workers alone)


@dataclass(frozen=True)
class Settings:
    sources: SourceSettings = field(default_factory=SourceSettings)
    registrations: RegistrationSettings = field(default_factory=RegistrationSettings)
    transport: TransportSettings = field(default_factory=TransportSettings)
    admin: AdminSettings = field(default_factory=AdminSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    workers: WorkerSettings = field(default_factory=WorkerSettings)
