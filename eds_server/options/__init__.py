"""`eds-server serve`'s options, declared by area beside the settings each makes (sources,
registrations, transport, admin, security, workers), validated once, into one `settings.Settings`
of frozen groups. A refusal is `parsing.Refused`: one line, exit status 2, before anything starts.

Each area module has `OPTIONS` (its flags, help and built-in defaults; the variable is EDS_ plus the
flag's name) and `settings(args)` (its group, or Refused). `HELP_LAYOUT` below is only where each
flag appears in `serve --help`. The standard library only at import: `--help` stays quick.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from . import admin, registrations, security, sources, transport, workers
from .parsing import LOGGING, HelpFormatter, Option

if TYPE_CHECKING:
    from ..settings import Settings

AREAS = (sources, registrations, admin, security, transport, workers)  # validated in this order

DESCRIPTION = (
    "Serve the groups of every source given to Envoy over gRPC (EDS, SotW and delta; no ADS). Every "
    "option can also be set by the environment variable shown in brackets. Durations take a unit: ms, s "
    "or m (500ms, 10s, 2m)."
)

# The order of `serve --help` (and of argparse's actions): runs of flags, each under its section
# (None: the ungrouped options, which argparse lists first). Every declared option appears once.
HELP_LAYOUT: tuple[tuple[str | None, tuple[str, ...]], ...] = (
    (
        None,
        (
            "--upstreams",
            "--listen",
            "--admin",
            "--metrics-listen",
            "--rest-listen",
            "--startup-timeout",
            "--shutdown-timeout",
            "--max-streams-per-connection",
        ),
    ),
    (
        "limits",
        (
            "--max-streams",
            "--max-upstreams-size",
            "--max-message-size",
            "--max-names",
            "--max-name-length",
            "--send-timeout",
            "--reset-budget",
        ),
    ),
    (
        "limits per client (gRPC port; see docs/limits.md)",
        (
            "--max-connections",
            "--max-connections-per-ip",
            "--stream-budget",
            "--control-frame-budget",
            "--request-timeout",
            "--connection-idle-timeout",
            "--partial-message-budget",
            "--memory-limit",
            "--tls-handshake-timeout",
            "--http-max-connections",
            "--http-timeout",
            "--http2",
        ),
    ),
    (None, ("--keepalive-time", "--keepalive-timeout", "--debounce")),
    (
        "Docker discovery",
        (
            "--docker",
            "--swarm",
            "--docker-host",
            "--docker-label-prefix",
            "--docker-network",
            "--docker-host-address",
            "--docker-address-mode",
        ),
    ),
    (
        "Kubernetes discovery",
        (
            "--kubernetes",
            "--kubernetes-namespace",
            "--kubeconfig",
            "--kubernetes-node-regions",
            "--kubernetes-annotation-prefix",
        ),
    ),
    ("TLS and authorization (gRPC port)", ("--tls-cert", "--tls-key", "--tls-client-ca", "--admin-tls", "--authz")),
    (
        "tiers and cores (docs/more-than-one-host.md)",
        ("--upstream-eds", "--upstream-eds-ca", "--upstream-eds-cert", "--upstream-eds-key", "--workers"),
    ),
    (
        "registration API (endpoints that are not containers)",
        (
            "--state",
            "--etcd-ca",
            "--etcd-cert",
            "--etcd-key",
            "--etcd-user",
            "--etcd-password-file",
            "--admin-token",
            "--max-registrations",
            "--registration-tokens",
            "--registration-allow-cidr",
        ),
    ),
    (None, ("--log-level", "--log-format")),
)


def declared() -> dict[str, Option]:
    """Every `serve` option by flag, from every area (and logging, which `demo` shares)."""
    out: dict[str, Option] = {}
    for option in (*(o for area in AREAS for o in area.OPTIONS), *LOGGING):
        assert option.flag not in out, f"{option.flag} declared twice"
        out[option.flag] = option
    return out


def add_serve(sub: Any) -> argparse.ArgumentParser:
    """The `serve` command's parser, on the subparsers `sub`."""
    serve: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="run the EDS server",
        formatter_class=HelpFormatter,
        usage="%(prog)s [OPTIONS]",
        description=DESCRIPTION,
    )
    options = declared()
    placed = [flag for _, flags in HELP_LAYOUT for flag in flags]
    assert sorted(placed) == sorted(options), f"HELP_LAYOUT and OPTIONS differ: {set(placed) ^ set(options)}"
    groups: dict[str | None, Any] = {None: serve}
    for title, flags in HELP_LAYOUT:
        if title not in groups:
            groups[title] = serve.add_argument_group(title)
        for flag in flags:
            options[flag].add_to(groups[title])
    return serve


def settings(args: argparse.Namespace) -> Settings:
    """`serve`'s parsed options as Settings, each area's group validated by its own module; raises
    parsing.Refused with the first problem found."""
    from ..settings import Settings

    return Settings(  # keyword arguments run in order: the areas' refusals come in AREAS' order
        sources=sources.settings(args),
        registrations=registrations.settings(args),
        admin=admin.settings(args),
        security=security.settings(args),
        transport=transport.settings(args),
        workers=workers.settings(args),
    )
