"""`serve`'s options for the operators' ports: the admin HTTP (status page, JSON, registration API),
its TLS, and the read-only port for scrapers and probes."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .parsing import Option, Refused, optional_address

if TYPE_CHECKING:
    from ..settings import AdminSettings

OPTIONS = (
    Option(
        "--admin",
        "admin HTTP address, or 'off' [EDS_ADMIN] (default 127.0.0.1:18001)",
        "127.0.0.1:18001",
        optional_address,
        "HOST:PORT",
    ),
    Option(
        "--metrics-listen",
        "read-only HTTP with /metrics, /healthz and /readyz alone, to expose to scrapers and "
        "probes on other hosts while --admin (the status page, the groups, the registration API) stays on "
        "loopback; or 'off' [EDS_METRICS_LISTEN] (default off)",
        "off",
        optional_address,
        "HOST:PORT",
    ),
    Option(
        "--admin-tls",
        "serve --admin (and the registration API on it) over HTTPS with the same --tls-cert and "
        "--tls-key; no client certificates (writes carry their tokens) [EDS_ADMIN_TLS=1]",
        kind="switch",
    ),
)


def settings(args: argparse.Namespace) -> AdminSettings:
    """The admin settings, or Refused: --admin-tls without the certificate it borrows, or without the admin HTTP."""
    from ..settings import AdminSettings

    if args.admin_tls and not args.tls_cert:
        raise Refused("--admin-tls needs --tls-cert (EDS_TLS_CERT): the admin port uses the gRPC port's certificate")
    if args.admin_tls and args.admin is None:
        raise Refused("--admin-tls needs the admin HTTP: drop --admin off, or --admin-tls")
    return AdminSettings(
        address=args.admin,
        metrics_listen=args.metrics_listen,
        tls_cert=args.tls_cert if args.admin_tls else None,
        tls_key=args.tls_key if args.admin_tls else None,
    )
