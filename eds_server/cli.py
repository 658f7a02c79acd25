"""Command line: `eds-server serve | check | demo`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import uvloop

from . import fields, upstreams
from .app import App, Settings
from .registration_api import (
    RegistrationConfigError,
    RegistrationPolicy,
    check_token,
    load_scoped_tokens,
    parse_cidrs,
)
from .security import SecurityConfigError
from .sources.containers import DockerOptions
from .sources.registrations import RegistrationStateError
from .transport.http2 import ConnectionLimits
from .transport.httplimits import HttpLimits
from .xds.common import Limits

log = logging.getLogger("eds_server")


def host_port(value: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT` or `:PORT` (all interfaces)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (host or "0.0.0.0", int(port))


def optional_address(value: str) -> tuple[str, int] | None:
    return None if value.lower() in ("", "off", "none") else host_port(value)


def positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return int(value)


def duration(value: str) -> float:
    """Seconds, with an optional unit: `10`, `10s`, `500ms`, `2m`."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0}
    for unit in ("ms", "s", "m"):
        if value.endswith(unit):
            number, scale = value[: -len(unit)], units[unit]
            break
    else:
        number, scale = value, 1.0
    try:
        seconds = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration (e.g. 10s, 500ms)") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is negative")
    return seconds


_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line; fields passed with `extra=` become keys of their own."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("grpclib", "watchfiles", "hpack", "h2", "aiodocker"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(name, default)


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def _ip(value: str) -> str:
    try:
        return fields.ip(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eds-server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the EDS server")
    serve.add_argument("--upstreams", metavar="FILE", default=_env("EDS_UPSTREAMS", None),
                       help="upstreams YAML file, watched for changes [EDS_UPSTREAMS]")
    serve.add_argument("--listen", type=host_port, metavar="HOST:PORT",
                       default=_env("EDS_LISTEN", "0.0.0.0:18000"),
                       help="gRPC address [EDS_LISTEN] (default 0.0.0.0:18000)")
    serve.add_argument("--admin", type=optional_address, metavar="HOST:PORT",
                       default=_env("EDS_ADMIN", "127.0.0.1:18001"),
                       help="admin HTTP address, or 'off' [EDS_ADMIN] (default 127.0.0.1:18001)")
    serve.add_argument("--rest-listen", type=optional_address, metavar="HOST:PORT",
                       default=_env("EDS_REST_LISTEN", "off"),
                       help="REST-JSON EDS for api_type: REST, or 'off' [EDS_REST_LISTEN] (default off)")
    serve.add_argument("--startup-timeout", type=duration, metavar="DURATION",
                       default=_env("EDS_STARTUP_TIMEOUT", "10s"),
                       help="longest wait for sources before answering Envoy anyway (default 10s)")
    serve.add_argument("--max-streams-per-connection", type=positive_int, metavar="N",
                       default=_env("EDS_MAX_STREAMS_PER_CONNECTION", "10000"),
                       help="HTTP/2 concurrent streams per connection (default 10000)")
    limits = serve.add_argument_group("limits")
    limits.add_argument("--max-streams", type=positive_int, metavar="N", default=_env("EDS_MAX_STREAMS", "100000"),
                        help="open xDS streams in total (default 100000)")
    limits.add_argument("--max-message-size", type=positive_int, metavar="BYTES",
                        default=_env("EDS_MAX_MESSAGE_SIZE", str(4 * 1024 * 1024)),
                        help="largest request accepted, judged from its length prefix (default 4 MiB)")
    limits.add_argument("--max-names", type=positive_int, metavar="N", default=_env("EDS_MAX_NAMES", "10000"),
                        help="resource names in one request (default 10000)")
    limits.add_argument("--max-name-length", type=positive_int, metavar="N",
                        default=_env("EDS_MAX_NAME_LENGTH", "1024"), help="characters in a name (default 1024)")
    limits.add_argument("--send-timeout", type=duration, metavar="DURATION", default=_env("EDS_SEND_TIMEOUT", "30s"),
                        help="drop a client that has not taken a response in this time (default 30s)")
    limits.add_argument("--reset-budget", type=positive_int, metavar="N", default=_env("EDS_RESET_BUDGET", "10000"),
                        help="client stream resets per connection per 10 s before GOAWAY (default 10000)")
    hostile = serve.add_argument_group("limits per client (gRPC port; see docs/limits.md)")
    hostile.add_argument("--max-connections", type=positive_int, metavar="N",
                         default=_env("EDS_MAX_CONNECTIONS", "10000"),
                         help="gRPC connections in total; more are closed with GOAWAY (default 10000)")
    hostile.add_argument("--max-connections-per-ip", type=positive_int, metavar="N",
                         default=_env("EDS_MAX_CONNECTIONS_PER_IP", "100"),
                         help="gRPC connections from one client IP (default 100)")
    hostile.add_argument("--stream-budget", type=positive_int, metavar="N", default=_env("EDS_STREAM_BUDGET", "1000"),
                         help="streams one client IP may open at once, refilled at this many per minute; more "
                              "are refused with REFUSED_STREAM and count as control frames (default 1000)")
    hostile.add_argument("--control-frame-budget", type=positive_int, metavar="N",
                         default=_env("EDS_CONTROL_FRAME_BUDGET", "1000"),
                         help="PING, SETTINGS, PRIORITY, empty DATA, unknown and unpaid WINDOW_UPDATE frames "
                              "one client IP may send per 10 s before GOAWAY (default 1000)")
    hostile.add_argument("--request-timeout", type=duration, metavar="DURATION",
                         default=_env("EDS_REQUEST_TIMEOUT", "10s"),
                         help="for a connection to open a stream, a stream to send its first request, and a "
                              "started request to arrive whole (default 10s)")
    hostile.add_argument("--partial-message-budget", type=positive_int, metavar="BYTES",
                         default=_env("EDS_PARTIAL_MESSAGE_BUDGET", str(64 * 1024 * 1024)),
                         help="bytes of requests being received at once, server-wide (default 64 MiB)")
    hostile.add_argument("--tls-handshake-timeout", type=duration, metavar="DURATION",
                         default=_env("EDS_TLS_HANDSHAKE_TIMEOUT", "5s"),
                         help="longest TLS handshake on the gRPC port (default 5s)")
    hostile.add_argument("--http-max-connections", type=positive_int, metavar="N",
                         default=_env("EDS_HTTP_MAX_CONNECTIONS", "256"),
                         help="connections to the admin port, and to the REST port, each (default 256)")
    hostile.add_argument("--http-timeout", type=duration, metavar="DURATION",
                         default=_env("EDS_HTTP_TIMEOUT", "10s"),
                         help="admin and REST ports: longest wait for a request's headers and body, and "
                              "keepalive of an idle connection (default 10s)")
    serve.add_argument("--keepalive-time", type=duration, metavar="DURATION",
                       default=_env("EDS_KEEPALIVE_TIME", "30s"),
                       help="HTTP/2 ping interval towards clients (default 30s)")
    serve.add_argument("--keepalive-timeout", type=duration, metavar="DURATION",
                       default=_env("EDS_KEEPALIVE_TIMEOUT", "10s"),
                       help="close a connection whose ping is not answered in this time (default 10s)")
    serve.add_argument("--debounce", type=duration, metavar="DURATION",
                       default=_env("EDS_DEBOUNCE", "50ms"),
                       help="coalesce bursts of source changes into one version (default 50ms)")
    docker = serve.add_argument_group("Docker discovery")
    docker.add_argument("--docker", action="store_true", default=_flag("EDS_DOCKER"),
                        help="follow labelled containers [EDS_DOCKER=1]")
    docker.add_argument("--swarm", action="store_true", default=_flag("EDS_SWARM"),
                        help="follow labelled Swarm services, from a manager [EDS_SWARM=1]")
    docker.add_argument("--docker-host", metavar="URL", default=_env("EDS_DOCKER_HOST", None),
                        help="engine address (default: DOCKER_HOST, else the local socket)")
    docker.add_argument("--docker-label-prefix", metavar="PREFIX",
                        default=_env("EDS_DOCKER_LABEL_PREFIX", "eds"), help="label prefix (default eds)")
    docker.add_argument("--docker-network", metavar="NAME", default=_env("EDS_DOCKER_NETWORK", None),
                        help="network whose address is used when a container has several")
    docker.add_argument("--docker-host-address", metavar="IP", type=_ip,
                        default=_env("EDS_DOCKER_HOST_ADDRESS", "127.0.0.1"),
                        help="address of host-network (and published) ports (default 127.0.0.1)")
    docker.add_argument("--docker-address-mode", choices=["network", "published"],
                        default=_env("EDS_DOCKER_ADDRESS_MODE", "network"),
                        help="container IP and port (network), or the published host port (published)")
    sec = serve.add_argument_group("TLS and authorization (gRPC port)")
    sec.add_argument("--tls-cert", metavar="FILE", default=_env("EDS_TLS_CERT", None),
                     help="PEM certificate chain: serve gRPC over TLS (1.2+, ALPN h2) [EDS_TLS_CERT]")
    sec.add_argument("--tls-key", metavar="FILE", default=_env("EDS_TLS_KEY", None),
                     help="PEM private key, unencrypted (default: in --tls-cert) [EDS_TLS_KEY]")
    sec.add_argument("--tls-client-ca", metavar="FILE", default=_env("EDS_TLS_CLIENT_CA", None),
                     help="require client certificates issued by these CAs (mTLS) [EDS_TLS_CLIENT_CA]")
    sec.add_argument("--authz", metavar="FILE", default=_env("EDS_AUTHZ", None),
                     help="which groups each client may read, by certificate or node [EDS_AUTHZ]")
    reg = serve.add_argument_group("registration API (endpoints that are not containers)")
    reg.add_argument("--state", metavar="FILE", default=_env("EDS_STATE", None),
                     help="registrations' state file, kept across restarts [EDS_STATE]")
    reg.add_argument("--admin-token", metavar="TOKEN", default=_env("EDS_ADMIN_TOKEN", None),
                     help="bearer token for registration writes on the admin HTTP; prefer EDS_ADMIN_TOKEN, "
                          "as arguments are visible to other local users [EDS_ADMIN_TOKEN]")
    reg.add_argument("--max-registrations", type=positive_int, metavar="N",
                     default=_env("EDS_MAX_REGISTRATIONS", "10000"),
                     help="most registrations kept; more are refused with 409 (default 10000)")
    reg.add_argument("--registration-tokens", metavar="FILE", default=_env("EDS_REGISTRATION_TOKENS", None),
                     help="scoped tokens: `tokens: [{token: ..., groups: [PATTERN, ...]}]`, each may write only "
                          "the groups its patterns match [EDS_REGISTRATION_TOKENS]")
    reg.add_argument("--registration-allow-cidr", metavar="CIDR", action="append",
                     default=[v for v in [_env("EDS_REGISTRATION_ALLOW_CIDRS", None)] if v],
                     help="allow registering addresses in this CIDR (repeatable, or comma-separated in "
                          "EDS_REGISTRATION_ALLOW_CIDRS); loopback, link-local, unspecified and multicast "
                          "addresses are refused otherwise")
    _add_logging(serve)

    check = sub.add_parser("check", help="validate an upstreams file (exit 1 on problems)")
    check.add_argument("file")

    demo = sub.add_parser("demo", help="run eds-server, sample backends and a real Envoy together")
    demo.add_argument("--upstreams", metavar="FILE", default="examples/upstreams.yaml")
    demo.add_argument("--envoy-config", metavar="FILE", default="envoy/envoy.yaml")
    _add_logging(demo)
    return parser  # fmt: skip


def _add_logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=_env("EDS_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"], help="[EDS_LOG_LEVEL]")
    p.add_argument("--log-format", default=_env("EDS_LOG_FORMAT", "text"),
                   choices=["text", "json"], help="[EDS_LOG_FORMAT]")  # fmt: skip


def check(path: str) -> int:
    try:
        groups = upstreams.load(path)
    except upstreams.UpstreamsError as e:
        for problem in e.problems:
            print(problem, file=sys.stderr)
        return 1
    n = sum(len(g.endpoints) for g in groups.values())
    print(f"{path}: ok ({len(groups)} groups, {n} endpoints)")
    return 0


async def serve(settings: Settings) -> int:
    app = App(settings)
    try:
        await app.start()
    except upstreams.UpstreamsError as e:
        for problem in e.problems:
            log.error("%s", problem)
        log.error("not starting: fix the upstreams file (check it with `eds-server check`)")
        return 1
    except SecurityConfigError as e:
        for reason in e.problems:
            log.error("%s", reason)
        log.error("not starting: fix the TLS or authorization settings")
        return 1
    except RegistrationStateError as e:
        log.error("not starting: %s", e)
        await app.stop()
        return 1
    except OSError as e:
        log.error("not starting: %s", e)
        await app.stop()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await app.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check":
        return check(args.file)
    setup_logging(args.log_level, args.log_format)
    if args.command == "demo":
        from .demo import run_demo

        return int(uvloop.run(run_demo(args.upstreams, args.envoy_config)))
    if not (args.upstreams or args.docker or args.swarm or args.state or args.admin_token
            or args.registration_tokens):  # fmt: skip
        log.error("no source of endpoints: give --upstreams FILE, --docker, --swarm and/or --state FILE with "
                  "--admin-token (EDS_UPSTREAMS, EDS_DOCKER, EDS_SWARM, EDS_STATE, EDS_ADMIN_TOKEN)")
        return 2
    if args.admin_token and args.admin is None:
        log.error("--admin-token needs the admin HTTP, which serves the registration API: drop --admin off")
        return 2
    if (args.tls_key or args.tls_client_ca) and not args.tls_cert:
        log.error("--tls-key and --tls-client-ca need --tls-cert (EDS_TLS_CERT)")
        return 2
    if args.authz and args.rest_listen is not None:
        log.error("--authz does not cover --rest-listen: REST would serve every group to anyone; use one of them")
        return 2
    try:
        if args.admin_token:
            check_token(args.admin_token)
        policy = RegistrationPolicy(
            scoped_tokens=load_scoped_tokens(args.registration_tokens) if args.registration_tokens else (),
            allow=parse_cidrs(args.registration_allow_cidr),
        )
    except RegistrationConfigError as e:
        log.error("%s", e)
        return 2
    if policy.scoped_tokens and args.admin is None:
        log.error("--registration-tokens needs the admin HTTP, which serves the registration API: drop --admin off")
        return 2
    docker = DockerOptions(
        label_prefix=args.docker_label_prefix,
        network=args.docker_network,
        host_address=args.docker_host_address,
        address_mode=args.docker_address_mode,
    )
    settings = Settings(
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        authz=args.authz,
        upstreams=args.upstreams,
        docker=docker if args.docker else None,
        swarm=docker if args.swarm else None,
        docker_host=args.docker_host,
        debounce=args.debounce,
        listen=args.listen,
        admin=args.admin,
        rest_listen=args.rest_listen,
        startup_timeout=args.startup_timeout,
        max_streams_per_connection=args.max_streams_per_connection,
        keepalive_time=args.keepalive_time,
        keepalive_timeout=args.keepalive_timeout,
        max_streams=args.max_streams,
        max_message_size=args.max_message_size,
        limits=Limits(max_names=args.max_names, max_name_length=args.max_name_length),
        send_timeout=args.send_timeout,
        reset_budget=args.reset_budget,
        connection_limits=ConnectionLimits(
            max_connections=args.max_connections,
            max_connections_per_ip=args.max_connections_per_ip,
            stream_budget=args.stream_budget,
            control_budget=args.control_frame_budget,
            request_timeout=args.request_timeout,
            partial_message_budget=args.partial_message_budget,
            tls_handshake_timeout=args.tls_handshake_timeout,
        ),
        http_limits=HttpLimits(max_connections=args.http_max_connections, timeout=args.http_timeout),
        state=args.state,
        admin_token=args.admin_token or None,
        max_registrations=args.max_registrations,
        registration_policy=policy,
    )
    return int(uvloop.run(serve(settings)))


if __name__ == "__main__":
    sys.exit(main())
