"""`serve`'s options for the registration API: where registrations are kept (a file, or etcd and
how to reach it), and who may write them."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from .parsing import Option, Refused, positive_int

if TYPE_CHECKING:
    from ..settings import RegistrationSettings
    from ..sources.etcd_client import EtcdOptions

OPTIONS = (
    Option(
        "--state",
        "where registrations are kept: a state file (one server), or etcd under PREFIX (replicas "
        "share them) [EDS_STATE]",
        metavar="FILE|etcd://HOST:PORT[,HOST:PORT...]/PREFIX",
    ),
    Option("--etcd-ca", "CA certificates to verify etcd's (turns TLS to etcd on) [EDS_ETCD_CA]", metavar="FILE"),
    Option("--etcd-cert", "client certificate for etcd, PEM (turns TLS to etcd on) [EDS_ETCD_CERT]", metavar="FILE"),
    Option("--etcd-key", "its private key (default: in --etcd-cert) [EDS_ETCD_KEY]", metavar="FILE"),
    Option(
        "--etcd-user",
        "etcd user (password from EDS_ETCD_PASSWORD or --etcd-password-file) [EDS_ETCD_USER]",
        metavar="USER",
    ),
    Option("--etcd-password-file", "file holding the etcd user's password [EDS_ETCD_PASSWORD_FILE]", metavar="FILE"),
    Option(
        "--admin-token",
        "bearer token for registration writes on the admin HTTP; prefer EDS_ADMIN_TOKEN, as "
        "arguments are visible to other local users [EDS_ADMIN_TOKEN]",
        metavar="TOKEN",
    ),
    Option(
        "--max-registrations",
        "most registrations kept; more are refused with 409 (default 10000)",
        "10000",
        positive_int,
        "N",
    ),
    Option(
        "--registration-tokens",
        "scoped tokens: `tokens: [{token: ..., groups: [PATTERN, ...], name: NAME}]`, "
        "each may write only the groups its patterns match; audit lines call it by its (optional) name",
        metavar="FILE",
    ),
    Option(
        "--registration-allow-cidr",
        "allow registering addresses in these CIDRs; loopback, link-local, "
        "unspecified and multicast addresses are refused otherwise",
        metavar="CIDR[,CIDR...]",
    ),
)


def settings(args: argparse.Namespace) -> RegistrationSettings:
    """The registration settings, or Refused: writes without the admin HTTP that serves them, a token
    too short, a tokens file or CIDR that does not load, etcd options that cannot work."""
    from ..registration_api import (
        RegistrationConfigError,
        RegistrationPolicy,
        check_token,
        load_scoped_tokens,
        parse_cidrs,
    )
    from ..settings import RegistrationSettings

    if args.admin_token and args.admin is None:
        raise Refused("--admin-token needs the admin HTTP, which serves the registration API: drop --admin off")
    try:
        if args.admin_token:
            check_token(args.admin_token)
        policy = RegistrationPolicy(
            scoped_tokens=load_scoped_tokens(args.registration_tokens) if args.registration_tokens else (),
            allow=parse_cidrs([args.registration_allow_cidr or ""]),
        )
    except RegistrationConfigError as e:
        raise Refused(str(e)) from None
    if policy.scoped_tokens and args.admin is None:
        raise Refused("--registration-tokens needs the admin HTTP, which serves the registration API: drop --admin off")
    return RegistrationSettings(
        state=args.state,
        etcd=etcd_options(args),
        admin_token=args.admin_token or None,
        max_registrations=args.max_registrations,
        policy=policy,
    )


def etcd_options(args: argparse.Namespace) -> EtcdOptions:
    """The etcd connection settings, or Refused: a bad state URL, a missing password or file."""
    import ssl

    from ..sources.etcd_client import EtcdOptions
    from ..sources.etcd_wire import is_etcd, parse_target

    etcd_flags = [
        f for f in ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file") if getattr(args, f)
    ]
    if not is_etcd(args.state):
        if etcd_flags:
            raise Refused(f"--{etcd_flags[0].replace('_', '-')} needs --state etcd://...")
        return EtcdOptions()
    try:
        parse_target(args.state)
    except ValueError as e:  # EtcdUrlError
        raise Refused(str(e)) from None
    password = os.environ.get("EDS_ETCD_PASSWORD")
    if args.etcd_password_file:
        try:
            with open(args.etcd_password_file, encoding="utf-8") as f:
                password = f.read(4096).strip()
        except OSError as e:
            raise Refused(f"--etcd-password-file {args.etcd_password_file}: {e.strerror or e}") from None
    if args.etcd_user and not password:
        raise Refused("--etcd-user needs a password: EDS_ETCD_PASSWORD or --etcd-password-file")
    if args.etcd_key and not args.etcd_cert:
        raise Refused("--etcd-key needs --etcd-cert")
    options = EtcdOptions(
        ca=args.etcd_ca,
        cert=args.etcd_cert,
        key=args.etcd_key,
        user=args.etcd_user,
        password=password if args.etcd_user else None,
    )
    for flag, path in (("--etcd-ca", args.etcd_ca), ("--etcd-cert", args.etcd_cert), ("--etcd-key", args.etcd_key)):
        if path and not os.path.isfile(path):
            raise Refused(f"{flag} {path}: no such file")
    try:
        options.ssl_context()  # unusable files stop the start here rather than at the first connection
    except (OSError, ssl.SSLError) as e:
        raise Refused(f"--etcd-ca, --etcd-cert, --etcd-key: cannot be used: {e}") from None
    return options
