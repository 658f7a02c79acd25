"""`serve`'s options for TLS on the gRPC port and the authorization file (who may read which groups)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .parsing import Option, Refused

if TYPE_CHECKING:
    from ..settings import SecuritySettings

OPTIONS = (
    Option("--tls-cert", "PEM certificate chain: serve gRPC over TLS (1.2+, ALPN h2) [EDS_TLS_CERT]", metavar="FILE"),
    Option("--tls-key", "PEM private key, unencrypted (default: the key in --tls-cert) [EDS_TLS_KEY]", metavar="FILE"),
    Option(
        "--tls-client-ca", "require client certificates issued by these CAs (mTLS) [EDS_TLS_CLIENT_CA]", metavar="FILE"
    ),
    Option("--authz", "which groups each client may read, by certificate or node [EDS_AUTHZ]", metavar="FILE"),
)


def settings(args: argparse.Namespace) -> SecuritySettings:
    """The security settings, or Refused: a key or client CA without a certificate (SecuritySettings'
    own check), an authorization file REST would not honour. The files are read when the App starts."""
    from ..settings import SecuritySettings

    try:
        security = SecuritySettings(
            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca, authz=args.authz
        )
    except ValueError as e:
        raise Refused(str(e)) from None
    if args.authz and args.rest_listen is not None:
        raise Refused("--authz does not cover --rest-listen: REST would serve every group to anyone; use one of them")
    return security
